"""The training examples run a few steps on the CPU with a tiny model and their loss falls."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("datasets")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "training_examples")
sys.path.insert(0, EXAMPLES)

import dpo_packed  # noqa: E402
import sft_packed  # noqa: E402

COMMON = ["--device", "cpu", "--model-size", "tiny", "--log-every", "2"]


def _falls(losses, by):
    head, tail = losses[:2], losses[-3:]
    return sum(tail) / len(tail) < sum(head) / len(head) - by


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_sft_packed_loss_falls(arch, capsys):
    res = sft_packed.main(COMMON + ["--arch", arch, "--steps", "12", "--max-length", "256", "--batch-size", "1"])
    out = capsys.readouterr().out
    assert len(res["losses"]) == 12
    assert _falls(res["losses"], 1.0), res["losses"]
    assert "tokens/s" in out and "peak mem" in out and "loss" in out
    assert res["tokens_per_s"] > 0


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_dpo_packed_loss_falls(arch, capsys):
    res = dpo_packed.main(COMMON + ["--arch", arch, "--steps", "12", "--max-length", "256", "--batch-size", "2",
                                    "--lr", "3e-3"])
    out = capsys.readouterr().out
    losses = res["losses"]
    assert len(losses) == 12
    assert abs(losses[0] - 0.6931) < 1e-3  # policy == reference at the first step: log(2)
    assert sum(losses[-4:]) / 4 < 0.45, losses
    assert "tokens/s" in out and "peak mem" in out and "acc" in out


def test_dpo_packed_with_sft_warmup_runs():
    res = dpo_packed.main(COMMON + ["--steps", "2", "--sft-steps", "2", "--max-length", "128", "--batch-size", "1"])
    assert len(res["losses"]) == 2


@pytest.mark.parametrize("script", ["sft_packed.py", "dpo_packed.py"])
def test_help_documents_the_options(script):
    r = subprocess.run([sys.executable, os.path.join(EXAMPLES, script), "--help"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    for opt in ("--model-size", "--max-length", "--steps", "--device", "--dtype", "--lr", "--log-every", "--arch",
                "--batch-size", "--data"):
        assert opt in r.stdout, opt


def test_bad_arguments_exit_with_a_message(capsys):
    with pytest.raises(SystemExit):
        sft_packed.main(["--steps", "0"])
    assert "--steps must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        dpo_packed.main(["--dtype", "float8"])


def test_shipped_data_is_what_the_generator_writes(tmp_path):
    sys.path.insert(0, os.path.join(EXAMPLES, "data"))
    import make_data

    make_data.main(str(tmp_path))
    for name in ("sft.jsonl", "dpo.jsonl"):
        with open(tmp_path / name) as a, open(os.path.join(EXAMPLES, "data", name)) as b:
            assert a.read() == b.read(), name
