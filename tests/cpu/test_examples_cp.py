"""The training examples under torchrun on the CPU (gloo, reference path, tiny model): FSDP2 and
context parallelism must not change the math.

Each test launches ``python -m torch.distributed.run --standalone`` (a few seconds each on two
cores) and compares the per-step losses in ``loss.csv`` with a run that has no context
parallelism: one process for dp=1, the same data-parallel size without CP for dp=2. Rows are
padded to multiples of ``8 x cp x --cp-align`` (8 here, 128 on GPUs); padding must not change
the loss either.
"""
import csv
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("datasets")
pytestmark = pytest.mark.slow  # each test trains in several processes

from tests import ROOT  # noqa: E402  (must follow the importorskip calls above)
from training_examples import dpo_packed, sft_packed  # noqa: E402

SFT = "training_examples.sft_packed"
DPO = "training_examples.dpo_packed"
BASE = ["--device", "cpu", "--model-size", "tiny", "--max-length", "256", "--batch-size", "1", "--cp-align", "8",
        "--progress", "off"]
DPO_BASE = ["--device", "cpu", "--model-size", "tiny", "--max-length", "256", "--batch-size", "2", "--cp-align", "8",
            "--progress", "off", "--lr", "3e-3", "--sft-steps", "2"]
REL = 1e-4


def torchrun(module, nproc, args):
    """Run ``-m module args`` in ``nproc`` processes from the checkout root; returns rank 0's stdout (the
    others print nothing)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone", "-m",
           module]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    r = subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=240, cwd=ROOT, env=env)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-4000:]}\n{r.stderr[-6000:]}"
    return r.stdout


def csv_column(directory, name="loss"):
    with open(os.path.join(directory, "loss.csv")) as f:
        return [float(row[name]) for row in csv.DictReader(f)]


def check_report(out, nproc, dp, cp):
    assert out.count("sft_packed:") + out.count("dpo_packed:") == 1, "rank 0 prints the start line once"
    assert f"dp={dp} x cp={cp}" in out and "attn_implementation=fm_cp" in out
    done = [line for line in out.splitlines() if line.startswith("done:")]
    assert len(done) == 1, out
    # CPU processes: throughput and memory per process, not "per GPU"
    assert "tokens/s/process" in done[0] and "GiB/process" in done[0] and "GPU" not in done[0], done[0]
    assert "peak mem" in done[0] and f"max over {nproc} ranks" in done[0], done[0]
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert steps and all("tokens/s/process" in s and "peak mem" in s and "GPU" not in s for s in steps), out


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """4 SFT steps in this process (checkpoints at steps 2 and 4): what every CP run must reproduce."""
    d = tmp_path_factory.mktemp("sft1")
    res = sft_packed.main(BASE + ["--steps", "4", "--save-every", "2", "--output-dir", str(d)])
    return d, res["losses"]


def test_sft_cp2_allgather_kv_equals_one_process(one_process, tmp_path):
    ref_dir, ref = one_process
    out = torchrun(SFT, 2, BASE + ["--cp", "2", "--steps", "4", "--save-every", "2", "--loss-chunk", "100",
                                   "--output-dir", str(tmp_path)])
    check_report(out, nproc=2, dp=1, cp=2)
    assert csv_column(tmp_path) == pytest.approx(ref, rel=REL)
    # The checkpoint written under FSDP2 is a plain Hugging Face model with the one-process weights.
    import transformers
    got = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "checkpoint-4")).state_dict()
    want = transformers.AutoModelForCausalLM.from_pretrained(str(ref_dir / "checkpoint-4")).state_dict()
    assert sorted(got) == sorted(want)
    for k in want:
        assert float((got[k] - want[k]).abs().max()) < 1e-4, k
    # ... and its optimizer state resumes in one process: the same steps 3 and 4.
    resumed = sft_packed.main(BASE + ["--steps", "4", "--resume", str(tmp_path / "checkpoint-2"),
                                      "--output-dir", str(tmp_path / "resumed")])
    assert resumed["losses"] == pytest.approx(ref, rel=REL)


def test_sft_cp2_ulysses_resumes_a_one_process_checkpoint(one_process, tmp_path):
    # Steps 3 and 4 under Ulysses CP with activation checkpointing (--offload on; these tiny layer
    # inputs stay under the offload threshold) and the MLPs of each rank's 128 tokens in chunks of
    # 40, from the one-process checkpoint-2: the model is loaded whole and then sharded, the
    # optimizer state sharded on load.
    ref_dir, ref = one_process
    out = torchrun(SFT, 2, BASE + ["--cp", "2", "--cp-mode", "ulysses", "--offload", "on", "--mlp-chunk", "40",
                                   "--steps", "4", "--resume", str(ref_dir / "checkpoint-2"),
                                   "--output-dir", str(tmp_path)])
    check_report(out, nproc=2, dp=1, cp=2)
    assert "resumed from" in out
    assert csv_column(tmp_path) == pytest.approx(ref, rel=REL)


def test_sft_cp2_sliding_window_equals_one_process(tmp_path):
    # A window of 8 tokens in every layer (the qwen2 preset), shorter than the documents: each
    # batch's plan is windowed in the attention layers.
    args = BASE + ["--arch", "qwen2", "--sliding-window", "8", "--steps", "2"]
    ref = sft_packed.main(args + ["--output-dir", str(tmp_path / "one")])["losses"]
    out = torchrun(SFT, 2, args + ["--cp", "2", "--output-dir", str(tmp_path / "cp")])
    check_report(out, nproc=2, dp=1, cp=2)
    assert csv_column(tmp_path / "cp") == pytest.approx(ref, rel=REL)
    full = sft_packed.main(BASE + ["--arch", "qwen2", "--steps", "2", "--output-dir", str(tmp_path / "full")])
    assert full["losses"] != pytest.approx(ref, rel=REL)  # the window matters


def test_sft_dp2_cp2_equals_dp2_without_cp(tmp_path):
    args = BASE + ["--steps", "3"]
    out = torchrun(SFT, 4, args + ["--cp", "2", "--output-dir", str(tmp_path / "cp")])
    check_report(out, nproc=4, dp=2, cp=2)
    torchrun(SFT, 2, args + ["--cp", "1", "--output-dir", str(tmp_path / "dp")])
    assert csv_column(tmp_path / "cp") == pytest.approx(csv_column(tmp_path / "dp"), rel=REL)
    # the two data-parallel groups trained on different rows: twice the documents of one
    assert csv_column(tmp_path / "cp", "docs") == csv_column(tmp_path / "dp", "docs")


def test_dpo_cp2_equals_one_process(tmp_path):
    ref = dpo_packed.main(DPO_BASE + ["--steps", "3"])
    out = torchrun(DPO, 2, DPO_BASE + ["--cp", "2", "--steps", "3", "--output-dir", str(tmp_path)])
    check_report(out, nproc=2, dp=1, cp=2)
    assert csv_column(tmp_path) == pytest.approx(ref["losses"], rel=REL)
    assert csv_column(tmp_path, "accuracy") == ref["accuracy"]
    assert os.path.isfile(tmp_path / "reference" / "config.json")


def test_cp_needs_as_many_processes(capsys):
    with pytest.raises(SystemExit):
        sft_packed.main(["--cp", "2"])
    assert "--cp 2 must divide the number of processes, 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        dpo_packed.main(["--loss-chunk", "-1"])
    assert "--loss-chunk must be >= 0" in capsys.readouterr().err
