"""The samples of a dataset as a list of dicts: JSON / JSONL / Parquet / CSV files (a file, a glob or a
directory) through ``datasets``, JSON files also without it, or a dataset name (needs the network)."""
from __future__ import annotations

import glob
import json
import os
from typing import Dict, List, Optional, Sequence

_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def load_records(spec: str, fields: Sequence[str], *, split: str = "train", config: Optional[str] = None,
                 max_samples: Optional[int] = None) -> List[Dict]:
    """The ``fields`` of every sample of a dataset, as a list of dicts.

    ``spec`` is a file (``.json`` / ``.jsonl`` / ``.parquet`` / ``.csv``), a glob of such files, a
    directory that ``datasets`` can read, or a dataset name (downloaded: needs the network).
    Without ``datasets`` installed, JSON and JSON-lines files are still read (with the json module).
    """
    files = sorted(glob.glob(spec)) if any(c in spec for c in "*?[") else ([spec] if os.path.isfile(spec) else [])
    try:
        import datasets
    except ImportError:
        if files and all(os.path.splitext(f)[1].lower() in (".json", ".jsonl") for f in files):
            return _json_records(files, fields, max_samples)
        raise ImportError(f"--data {spec}: reading it needs the `datasets` package (pip install datasets); "
                          f"JSON / JSONL files are read without it") from None

    datasets.disable_progress_bars()
    if files:
        exts = {os.path.splitext(f)[1].lower() for f in files}
        if len(exts) != 1 or next(iter(exts)) not in _FILE_BUILDERS:
            raise ValueError(f"--data {spec}: expected .json, .jsonl, .parquet or .csv files, got {sorted(exts)}")
        builder = _FILE_BUILDERS[exts.pop()]
        # CSV cells are typed by guessing: read the text fields as written ("42." stays a string).
        kwargs = {"converters": {f: str for f in fields}} if builder == "csv" else {}
        ds = datasets.load_dataset(builder, data_files=files, split="train", **kwargs)
    elif os.path.isdir(spec):
        ds = datasets.load_dataset(spec, split=split)
    else:
        try:
            ds = datasets.load_dataset(spec, config, split=split)
        except Exception as e:  # noqa: BLE001 - say what was tried, keep the cause
            raise RuntimeError(f"--data {spec}: not a local file or directory, and loading it as a dataset name "
                               f"failed (offline, or a wrong name/config/split?): {e}") from e
    missing = [f for f in fields if f not in ds.column_names]
    if missing:
        raise ValueError(f"--data {spec}: no field {missing[0]!r}; its fields are {ds.column_names} "
                         f"(choose them with the --*-field options)")
    if max_samples is not None:
        ds = ds.select(range(min(max_samples, len(ds))))
    ds = ds.select_columns(list(fields))
    return [r for r in ds if all(r[f] is not None for f in fields)]


def _json_records(files: Sequence[str], fields: Sequence[str], max_samples: Optional[int]) -> List[Dict]:
    """What load_records returns for JSON / JSON-lines files, read without ``datasets``: a machine
    without it (a GPU box with no package index) still trains on the shipped data."""
    rows: List[Dict] = []
    for path in files:
        with open(path) as f:
            text = f.read()
        stripped = text.lstrip()
        if stripped.startswith("["):
            rows.extend(json.loads(text))
        else:
            rows.extend(json.loads(line) for line in text.splitlines() if line.strip())
    if rows:
        missing = [f for f in fields if f not in rows[0]]
        if missing:
            raise ValueError(f"--data {files[0]}: no field {missing[0]!r}; its fields are {sorted(rows[0])} "
                             f"(choose them with the --*-field options)")
    if max_samples is not None:
        rows = rows[:max_samples]
    return [{f: r[f] for f in fields} for r in rows if all(r.get(f) is not None for f in fields)]
