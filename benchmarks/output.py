"""What the benchmark scripts write: CSV and JSON results (``runs/<name>`` by default),
the versions and device for their metadata, and matplotlib for plots (imported where used)."""
from __future__ import annotations

import csv
import json
import os
import sys
import time
from typing import List, Sequence, Tuple

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def csv_value(v):
    if isinstance(v, float):
        return f"{v:.6g}"
    return "" if v is None else v


def write_results(out_dir: str, stem: str, rows: List[dict], fields: Sequence[str], meta: dict) -> Tuple[str, str]:
    """``out_dir/stem.csv`` and ``out_dir/stem.json`` (``{"meta": ..., "rows": [...]}``)."""
    os.makedirs(out_dir, exist_ok=True)
    csv_path, json_path = os.path.join(out_dir, stem + ".csv"), os.path.join(out_dir, stem + ".json")
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(fields), extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: csv_value(r.get(k)) for k in fields})
    with open(json_path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1, default=str)
    return csv_path, json_path


def default_out_dir(name: str) -> str:
    """``runs/<name>`` in the checkout (ignored by git): benchmarks/results/ holds only published tables."""
    return os.path.join(ROOT, "runs", name)


def environment(device: torch.device) -> dict:
    """Versions and the device, for the JSON metadata."""
    env = {"torch": torch.__version__, "python": sys.version.split()[0], "device": str(device),
           "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    if device.type == "cuda" and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    try:
        import triton
        env["triton"] = triton.__version__
    except Exception:
        env["triton"] = None
    try:
        import flashmask
        env["flashmask"] = flashmask.__version__
        env["flashmask_kernels"] = flashmask.cuda.available()
    except Exception as e:  # pragma: no cover
        env["flashmask"] = f"import failed: {e}"
    return env


def pyplot():
    """matplotlib.pyplot with the Agg backend (no display needed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt
