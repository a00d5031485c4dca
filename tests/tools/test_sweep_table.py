"""tools/sweep_table.py: the variant sweep's side-by-side table, from fake per-variant CSVs."""
import csv
import os

from tools import sweep_table

FIELDS = ["family", "seqlen", "head_dim", "mode", "method", "status", "tflops"]


def write_csv(out, name, rows):
    os.makedirs(os.path.join(out, name))
    with open(os.path.join(out, name, "kernels.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow(dict(zip(FIELDS, r)))


def test_modes_and_methods_keep_their_own_cells(tmp_path):
    out = str(tmp_path)
    write_csv(out, "main", [("causal", 8192, 64, "fwd", "flashmask", "ok", 400.0),
                            ("causal", 8192, 64, "bwd", "flashmask", "ok", 300.0),
                            ("causal", 8192, 64, "bwd", "flashmask_det", "ok", 250.0),
                            ("full", 8192, 64, "fwd", "flashmask", "error", 0.0)])
    write_csv(out, "next", [("causal", 8192, 64, "fwd", "flashmask", "ok", 420.0),
                            ("causal", 8192, 64, "bwd", "flashmask_sm80", "ok", 200.0)])
    columns, rows = sweep_table.collect(out, ["main", "next", "missing"])
    assert columns == ["main", "main_det", "next", "next_sm80"]
    assert rows[(64, "causal", 8192, "fwd")] == {"main": 400.0, "next": 420.0}
    assert rows[(64, "causal", 8192, "bwd")] == {"main": 300.0, "main_det": 250.0, "next_sm80": 200.0}
    assert (64, "full", 8192, "fwd") not in rows  # failed rows are left out
    text = sweep_table.write(out, ["main", "next"])
    assert len(text.splitlines()) == 3
    with open(os.path.join(out, "sweep.csv")) as f:
        table = list(csv.reader(f))
    assert table[0] == ["head_dim", "family", "seqlen", "mode", "main", "main_det", "next", "next_sm80"]
    assert table[1] == ["64", "causal", "8192", "bwd", "300.0", "250.0", "", "200.0"]


def test_main_prints_the_table_and_refuses_a_missing_folder(tmp_path, capsys):
    write_csv(str(tmp_path), "main", [("causal", 8192, 64, "fwd", "flashmask", "ok", 400.0)])
    sweep_table.main([str(tmp_path), "main"])
    assert capsys.readouterr().out.splitlines()[1].split() == ["64", "causal", "8192", "fwd", "400.0"]
    try:
        sweep_table.main([str(tmp_path / "missing")])
    except SystemExit as e:
        assert e.code == 2
    else:
        raise AssertionError("a missing folder must be refused")
    assert "no such folder" in capsys.readouterr().err
