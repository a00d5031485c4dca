"""The samples of a dataset as a list of dicts: JSON / JSONL / Parquet / CSV files (a file, a glob or a
directory) through ``datasets``, JSON files also without it, or a dataset name (needs the network)."""
from __future__ import annotations

import glob
import json
import os
from typing import Dict, List, Optional, Sequence

_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


class DataError(ValueError):
    """``--data`` that cannot be used as given; the message names the file (and the line) and says why."""


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

    try:
        return _dataset_records(datasets, spec, files, fields, split, config, max_samples)
    except DataError:
        raise
    except Exception:
        for path in files:  # datasets' message names neither the file nor the line of bad JSON: find them
            if os.path.splitext(path)[1].lower() in (".json", ".jsonl"):
                _read_json_rows(path)
        raise


def _dataset_records(datasets, spec: str, files: Sequence[str], fields: Sequence[str], split: str,
                     config: Optional[str], max_samples: Optional[int]) -> List[Dict]:
    """What load_records returns, read by ``datasets``."""
    datasets.disable_progress_bars()
    if files:
        exts = {os.path.splitext(f)[1].lower() for f in files}
        if len(exts) != 1 or next(iter(exts)) not in _FILE_BUILDERS:
            raise DataError(f"--data {spec}: expected .json, .jsonl, .parquet or .csv files, got {sorted(exts)}")
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
        raise DataError(f"--data {spec}: no field {missing[0]!r}; its fields are {ds.column_names} "
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
        rows.extend(_read_json_rows(path))
    if rows:
        missing = [f for f in fields if f not in rows[0]]
        if missing:
            raise DataError(f"--data {files[0]}: no field {missing[0]!r}; its fields are {sorted(rows[0])} "
                            f"(choose them with the --*-field options)")
    if max_samples is not None:
        rows = rows[:max_samples]
    return [{f: r[f] for f in fields} for r in rows if all(r.get(f) is not None for f in fields)]


def _read_json_rows(path: str) -> List[Dict]:
    """The objects of a JSON file (an array of objects) or a JSON-lines file (an object a line); a
    :class:`DataError` names the line where the file stops being one."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise DataError(f"--data {path}: line {line}: not UTF-8 text") from None
    if text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"--data {path}: line {e.lineno}: not valid JSON ({e.msg}, column {e.colno})") from None
        for i, row in enumerate(rows):
            if not isinstance(row, dict):
                raise DataError(f"--data {path}: item {i} of the array is a JSON {type(row).__name__}, "
                                "expected an object of fields")
        return rows
    rows = []
    for n, line in enumerate(text.split("\n"), 1):  # not splitlines(): a JSON string may hold U+2028
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"--data {path}: line {n}: not valid JSON ({e.msg}, column {e.colno})") from None
        if not isinstance(row, dict):
            raise DataError(f"--data {path}: line {n}: a JSON {type(row).__name__}, expected an object of fields")
        rows.append(row)
    return rows
