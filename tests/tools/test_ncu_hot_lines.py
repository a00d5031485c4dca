"""tools/ncu_hot_lines.py on a small CSV shaped like ncu's source page."""
import subprocess
import sys

import pytest

from tests import ROOT

HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
          '"stall_barrier","stall_long_sb","stall_wait","stall_barrier (Not Issued)"')


def run(tmp_path, text, *args):
    path = tmp_path / "src.csv"
    path.write_text(text)
    return subprocess.run([sys.executable, "-m", "tools.ncu_hot_lines", str(path), *args], capture_output=True,
                          text=True, cwd=ROOT)


def test_lines_ranked_by_samples_with_their_reasons(tmp_path):
    text = "\n".join([
        "==PROF== Connected to process 1",
        HEADER,
        '"0x10","HGMMA.64x64x16.F32.BF16 R24","1,200","900","0","100","1,100","0"',
        '"0x20","STSM.16.MT88.4 [R45], R56","3,000","2,500","2,900","50","0","7"',
        '"0x30","FENCE.VIEW.ASYNC.S","800","700","0","780","20","0"',
    ])
    r = run(tmp_path, text, "--top", "2")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "5000 stall samples over 3 instructions"
    assert len(lines) == 3  # --top 2
    assert "STSM" in lines[1] and "60.0%" in lines[1] and "barrier 2900, long_sb 50" in lines[1]
    assert "HGMMA" in lines[2] and "wait 1100, long_sb 100" in lines[2]


@pytest.mark.parametrize("text", ["", "a,b\n1,2\n"])
def test_a_csv_without_the_sampling_column_is_refused(tmp_path, text):
    r = run(tmp_path, text)
    assert r.returncode != 0 and "Warp Stall Sampling" in r.stderr
