"""tools/sweep_variants.sh on a CPU, in a throwaway git repository whose setup.py and
benchmarks.bench_kernels stand in for the build and the benchmark: revisions and the working tree
become worktrees, each is built and timed, passes run in reverse order, and bad arguments are named."""
import csv
import os
import shutil
import subprocess
import sys

import pytest

from tests import ROOT

GIT_ID = ["-c", "user.name=t", "-c", "user.email=t@example.com"]

FAKE_SETUP = """\
import os
os.makedirs("flashmask", exist_ok=True)
open(os.path.join("flashmask", "_C.fake.so"), "w").close()
print("ptxas info    : Used 100 registers, used 1 barriers")
if os.path.exists("serialised.txt"):
    print("ptxas info    : (C7518) Potential Performance Loss: wgmma.mma_async instructions are serialized "
          "in the function 'k'")
"""

# Writes one row per mode with the TFLOP/s in speed.txt, and the arguments it got.
FAKE_BENCH = """\
import argparse, csv, os, sys
p = argparse.ArgumentParser()
p.add_argument("--out")
p.add_argument("--modes")
args, _ = p.parse_known_args()
os.makedirs(args.out, exist_ok=True)
with open(os.path.join(args.out, "args.txt"), "w") as f:
    f.write(" ".join(sys.argv[1:]))
with open(os.path.join(args.out, "kernels.csv"), "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["family", "seqlen", "head_dim", "mode", "method", "status", "tflops"])
    for mode in args.modes.split(","):
        w.writerow(["causal", 8192, 64, mode, "flashmask", "ok", open("speed.txt").read().strip()])
"""


def git(repo, *args):
    subprocess.run(["git", *GIT_ID, *args], cwd=repo, check=True, capture_output=True)


@pytest.fixture
def repo(tmp_path):
    """A repository with the sweep's tools, commit `main` at 100 TFLOP/s, branch `fast` at 200
    (with a serialised wgmma), and the working tree changed to 300."""
    repo = tmp_path / "repo"
    (repo / "tools").mkdir(parents=True)
    (repo / "benchmarks").mkdir()
    (repo / "csrc").mkdir()
    for name in ("__init__.py", "sweep_variants.sh", "sweep_table.py", "compile_check.py"):
        shutil.copy(os.path.join(ROOT, "tools", name), repo / "tools" / name)
    shutil.copy(os.path.join(ROOT, "csrc", "instantiations.py"), repo / "csrc" / "instantiations.py")
    (repo / "benchmarks" / "__init__.py").write_text("")
    (repo / "benchmarks" / "bench_kernels.py").write_text(FAKE_BENCH)
    (repo / "setup.py").write_text(FAKE_SETUP)
    (repo / ".gitignore").write_text("*.so\n__pycache__/\n")
    (repo / "speed.txt").write_text("100\n")
    subprocess.run(["git", "init", "-q", "-b", "main"], cwd=repo, check=True)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "base")
    git(repo, "checkout", "-q", "-b", "fast")
    (repo / "speed.txt").write_text("200\n")
    (repo / "serialised.txt").write_text("")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "faster")
    git(repo, "checkout", "-q", "main")
    (repo / "speed.txt").write_text("300\n")
    return repo


def sweep(repo, *args, cwd=None, **env):
    # No git identity configured: the working tree's stash commit must not need one.
    env = {**os.environ, "SCRATCH": str(repo.parent / "scratch"), "PYTHON": sys.executable,
           "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1", "MAX_JOBS": "2", **env}
    return subprocess.run(["bash", str(repo / "tools" / "sweep_variants.sh"), *args], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=300)


@pytest.mark.slow  # a handful of git and python processes per variant
def test_revisions_and_working_tree_side_by_side(repo, tmp_path):
    out = tmp_path / "out"
    r = sweep(repo, str(out), "base=main", "fast", ".", FAMILIES="causal,full", PASSES="2", MODES="fwd")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "built 3 variants" in r.stdout
    assert "WARNING: fast: wgmma serialised (ptxas C7518) in 1 kernels" in r.stdout
    assert "WARNING: base" not in r.stdout and "WARNING: worktree" not in r.stdout
    assert r.stdout.count("SASS not checked") == 3  # a stand-in extension: no kernels to read
    with open(out / "sweep.csv") as f:
        table = list(csv.reader(f))
    assert table == [["head_dim", "family", "seqlen", "mode", "base", "fast", "worktree", "worktree_2", "fast_2",
                      "base_2"],
                     ["64", "causal", "8192", "fwd", "100.0", "200.0", "300.0", "300.0", "200.0", "100.0"]]
    assert "--families causal,full" in (out / "fast" / "args.txt").read_text()
    assert (out / "build_base.log").exists() and (out / "bench_fast_2.log").exists()
    # The working tree itself is left as it was, and a second sweep reuses the worktrees; a relative
    # OUTDIR is the caller's.
    assert (repo / "speed.txt").read_text() == "300\n"
    r = sweep(repo, "out", "base=fast", cwd=tmp_path, MODES="bwd")
    assert r.returncode == 0, r.stdout + r.stderr
    with open(out / "sweep.csv") as f:
        assert list(csv.reader(f))[1] == ["64", "causal", "8192", "bwd", "200.0"]


@pytest.mark.parametrize("args,message", [
    (["OUT"], "expected OUTDIR and at least one revision, got 1 argument(s)"),
    (["OUT", "nope"], "'nope' (variant nope) is no revision of this checkout"),
    (["OUT", "a=main", "a=fast"], "variant name 'a' given twice"),
    (["OUT", "1x=main"], "variant name '1x' (from '1x=main'): expected letters, digits and _"),
])
def test_bad_arguments_are_named(repo, tmp_path, args, message):
    r = sweep(repo, *[str(tmp_path / a) if a == "OUT" else a for a in args])
    assert r.returncode == 2
    assert message in r.stderr and "usage: bash tools/sweep_variants.sh OUTDIR" in r.stderr
    assert not (tmp_path / "OUT").exists()


def test_a_scratch_folder_that_is_no_worktree_is_left_alone(repo, tmp_path):
    (tmp_path / "scratch" / "main").mkdir(parents=True)
    (tmp_path / "scratch" / "main" / "keep.txt").write_text("mine")
    r = sweep(repo, str(tmp_path / "out"), "main")
    assert r.returncode == 2 and "exists and is no worktree of this checkout" in r.stderr
    assert (tmp_path / "scratch" / "main" / "keep.txt").read_text() == "mine"
