"""tools/compare_kernels.py: new/old TFLOP/s of one method per case present in both CSVs."""
import csv

import pytest

from tools import compare_kernels

FIELDS = ["family", "seqlen", "head_dim", "mode", "method", "status", "tflops"]


def _csv(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow(dict(zip(FIELDS, r)))
    return str(path)


def test_ratios_of_common_cases(tmp_path, capsys):
    old = _csv(tmp_path / "old.csv", [("causal", 8192, 128, "fwd", "flashmask", "ok", 300),
                                      ("full", 8192, 128, "fwd", "flashmask", "ok", 400),
                                      ("causal", 8192, 128, "fwd", "flex", "ok", 100)])
    new = _csv(tmp_path / "new.csv", [("causal", 8192, 128, "fwd", "flashmask", "ok", 330),
                                      ("full", 8192, 128, "fwd", "flashmask", "oom", 0),
                                      ("causal", 8192, 128, "fwd", "flex", "ok", 500)])
    ratios = compare_kernels.main([old, new])
    assert ratios == pytest.approx([1.1])  # failed rows and other methods are left out
    assert "1 cases: median new/old 1.100" in capsys.readouterr().out
    assert compare_kernels.main([old, new, "--method", "flex"]) == pytest.approx([5.0])


def test_no_common_case_says_so(tmp_path):
    old = _csv(tmp_path / "old.csv", [("causal", 8192, 128, "fwd", "flashmask", "ok", 300)])
    new = _csv(tmp_path / "new.csv", [("causal", 32768, 128, "fwd", "flashmask", "ok", 300)])
    with pytest.raises(SystemExit, match="no flashmask case is in both files"):
        compare_kernels.main([old, new])
