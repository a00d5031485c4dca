"""The training examples on the CPU with a tiny model: the loss falls, checkpoints reload (with
``--model`` and ``--resume``), and the loss curve is written."""
import csv
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("datasets")

from tests import ROOT

EXAMPLES = os.path.join(ROOT, "training_examples")

from training_examples import dpo_packed, sft_packed  # noqa: E402
from training_examples.dpo_loss import preference_accuracy  # noqa: E402

COMMON = ["--device", "cpu", "--model-size", "tiny", "--log-every", "2"]


def _falls(losses, by):
    head, tail = losses[:2], losses[-3:]
    return sum(tail) / len(tail) < sum(head) / len(head) - by


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_sft_packed_loss_falls(arch, capsys):
    res = sft_packed.main(COMMON + ["--arch", arch, "--steps", "12", "--max-length", "256", "--batch-size", "1"])
    out = capsys.readouterr().out
    assert len(res["losses"]) == 12
    assert _falls(res["losses"], 1.0), res["losses"]
    assert "tokens/s" in out and "peak mem" in out and "loss" in out
    assert res["tokens_per_s"] > 0
    assert res["checkpoint"] is None and res["loss_csv"] is None  # no --output-dir: nothing written


SFT_SHORT = COMMON + ["--max-length", "256", "--batch-size", "1"]


@pytest.mark.slow
def test_sft_checkpoints_resume_and_loss_curve(tmp_path):
    straight = sft_packed.main(SFT_SHORT + ["--steps", "8", "--output-dir", str(tmp_path / "a")])
    assert _falls(straight["losses"], 0.5), straight["losses"]
    # Stop at 4 (checkpoint-4), resume to 8: the same losses as the uninterrupted run, so the model,
    # the optimizer and the position in the data all came back from the checkpoint.
    sft_packed.main(SFT_SHORT + ["--steps", "4", "--output-dir", str(tmp_path / "b")])
    resumed = sft_packed.main(SFT_SHORT + ["--steps", "8", "--resume", str(tmp_path / "b")])
    assert resumed["checkpoint"] == str(tmp_path / "b" / "checkpoint-8")
    assert resumed["losses"] == pytest.approx(straight["losses"], rel=1e-5, abs=1e-6)
    # The loss curve: one CSV row per step (the resumed run rewrote the first four), and a PNG.
    with open(resumed["loss_csv"]) as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(1, 9))
    assert {"loss", "tokens_per_s", "elapsed_s"} <= set(rows[0])
    with open(tmp_path / "b" / "loss.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_resume_past_steps_says_there_is_nothing_to_train(tmp_path, capsys):
    sft_packed.main(SFT_SHORT + ["--steps", "2", "--output-dir", str(tmp_path), "--progress", "off"])
    capsys.readouterr()
    for steps in ("2", "1"):
        res = sft_packed.main(SFT_SHORT + ["--steps", steps, "--resume", str(tmp_path), "--progress", "off"])
        out = capsys.readouterr().out
        assert f"checkpoint at step 2 >= --steps {steps}: nothing to train" in out, out
        assert res["checkpoint"] is None and len(res["losses"]) == 2  # the checkpoint's history, no new step


@pytest.mark.slow
def test_checkpoint_reloads_as_a_hugging_face_model(tmp_path):
    first = sft_packed.main(SFT_SHORT + ["--steps", "10", "--output-dir", str(tmp_path)])
    ckpt = first["checkpoint"]
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt)
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    assert tok("hi", add_special_tokens=False)["input_ids"] == [104, 105] and tok.eos_token_id == 258
    assert model.config.num_hidden_layers == 2
    # --model CHECKPOINT goes on from the trained weights: its first loss is near where the first
    # run ended, far below a fresh model's ln(320) = 5.77.
    again = sft_packed.main(SFT_SHORT + ["--steps", "2", "--model", ckpt, "--seed", "1"])
    assert again["first_loss"] < first["first_loss"] - 1.0, (first["losses"], again["losses"])


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_dpo_packed_loss_falls(arch, capsys):
    res = dpo_packed.main(COMMON + ["--arch", arch, "--steps", "12", "--max-length", "256", "--batch-size", "2",
                                    "--lr", "3e-3"])
    out = capsys.readouterr().out
    losses = res["losses"]
    assert len(losses) == 12
    assert abs(losses[0] - 0.6931) < 1e-3  # policy == reference at the first step: log(2)
    assert res["accuracy"][0] == 0.5  # ... and every margin a tie, counted as half
    assert sum(losses[-4:]) / 4 < 0.45, losses
    assert "tokens/s" in out and "peak mem" in out and "acc" in out


def test_preference_accuracy_counts_ties_as_half():
    assert float(preference_accuracy(torch.tensor([0.3, 0.0, -0.2, 0.0]))) == 0.5
    assert float(preference_accuracy(torch.zeros(3))) == 0.5
    assert float(preference_accuracy(torch.tensor([1e-6, -1e-6]))) == 0.5


def test_dpo_packed_with_sft_warmup_runs():
    res = dpo_packed.main(COMMON + ["--steps", "2", "--sft-steps", "2", "--max-length", "128", "--batch-size", "1"])
    assert len(res["losses"]) == 2


@pytest.mark.slow
def test_dpo_resume_reloads_policy_and_reference(tmp_path):
    args = COMMON + ["--max-length", "256", "--batch-size", "2", "--lr", "3e-3", "--sft-steps", "2"]
    straight = dpo_packed.main(args + ["--steps", "6", "--output-dir", str(tmp_path / "a")])
    dpo_packed.main(args + ["--steps", "6", "--save-every", "3", "--output-dir", str(tmp_path / "b")])
    resumed = dpo_packed.main(args + ["--steps", "6", "--resume", str(tmp_path / "b" / "checkpoint-3"),
                                      "--output-dir", str(tmp_path / "c")])
    assert os.path.isdir(tmp_path / "b" / "reference")
    assert resumed["losses"] == pytest.approx(straight["losses"], rel=1e-5, abs=1e-6)
    assert resumed["accuracy"] == straight["accuracy"]


def test_progress_bar_on_request(capsys):
    sft_packed.main(SFT_SHORT + ["--steps", "2", "--progress", "on"])
    err = capsys.readouterr().err
    assert "sft_packed" in err and "2/2" in err and "tok_s=" in err


@pytest.mark.parametrize("module", ["training_examples.sft_packed", "training_examples.dpo_packed"])
def test_help_documents_the_options(module):
    r = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr
    for opt in ("--model-size", "--max-length", "--steps", "--device", "--dtype", "--lr", "--log-every", "--arch",
                "--batch-size", "--data", "--model", "--output-dir", "--save-every", "--resume", "--progress",
                "--data-split", "--offload", "--mlp-chunk", "--loss-chunk"):
        assert opt in r.stdout, opt


@pytest.mark.slow
def test_mlp_chunk_default_follows_offload_and_leaves_the_losses(monkeypatch):
    assert sft_packed.parse_args([]).mlp_chunk == 0
    assert sft_packed.parse_args(["--offload", "on"]).mlp_chunk == 65536
    assert dpo_packed.parse_args(["--offload", "auto"]).mlp_chunk == 65536
    assert sft_packed.parse_args(["--offload", "on", "--mlp-chunk", "0"]).mlp_chunk == 0
    import flashmask.checkpointing as ckpt

    calls = []
    real = ckpt.chunk_mlp
    monkeypatch.setattr(ckpt, "chunk_mlp", lambda model, n: (calls.append(n), real(model, n))[1])
    # chunks of 50 tokens, 256-token rows; DPO also chunks its frozen reference (forward without grad)
    for main, extra in ((sft_packed.main, ["--batch-size", "1"]), (dpo_packed.main, ["--batch-size", "2"])):
        args = COMMON + ["--steps", "2", "--max-length", "256", "--progress", "off"] + extra
        plain = main(args)
        calls.clear()
        chunked = main(args + ["--mlp-chunk", "50"])
        assert calls == [50] * (1 if main is sft_packed.main else 2)
        assert chunked["losses"] == pytest.approx(plain["losses"], rel=1e-5, abs=1e-6)


def test_keep_attention_trains_as_plain_checkpointing():
    """--keep-attention: the kernels' stand-ins run the attention; the losses are those of plain
    checkpointing and no attention forward runs in the backward (one per layer and step, not two)."""
    from tests import cpu_kernels

    args = COMMON + ["--steps", "2", "--max-length", "128", "--batch-size", "1", "--progress", "off",
                     "--gradient-checkpointing"]
    runs = {}
    for extra in ([], ["--keep-attention"]):
        with cpu_kernels.in_place_of_the_kernels() as calls:
            runs[bool(extra)] = sft_packed.main(args + extra)["losses"], calls.count("fwd"), calls.count("bwd")
    (plain, plain_fwd, plain_bwd), (kept, kept_fwd, kept_bwd) = runs[False], runs[True]
    assert kept == pytest.approx(plain, rel=1e-6) and plain_bwd == kept_bwd > 0
    assert plain_fwd == 2 * kept_fwd


def test_bad_arguments_exit_with_a_message(capsys):
    with pytest.raises(SystemExit):
        sft_packed.main(["--steps", "0"])
    assert "--steps must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        dpo_packed.main(["--dtype", "float8"])
    with pytest.raises(SystemExit):
        sft_packed.main(["--model", "/nonexistent/model"])
    assert "not a directory" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sft_packed.main(["--resume", "/nonexistent/run"])
    assert "checkpoint" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sft_packed.main(["--mlp-chunk", "-1"])
    assert "--mlp-chunk must be >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sft_packed.main(["--keep-attention"])
    assert "--keep-attention needs --gradient-checkpointing" in capsys.readouterr().err


def test_malformed_data_file_ends_the_run_with_one_line(tmp_path):
    bad = tmp_path / "pairs.jsonl"
    bad.write_text('{"instruction": "a", "response": "b"}\n{"instruction": "c", "response": "d",}\n')
    for main in (sft_packed.main, dpo_packed.main):
        with pytest.raises(SystemExit) as e:
            main(SFT_SHORT + ["--steps", "1", "--data", str(bad)])
        msg = str(e.value.code)
        assert msg.startswith(f"error: --data {bad}: line 2: not valid JSON") and "\n" not in msg, msg


def test_device_without_cuda_is_one_clear_error(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for main, device in ((sft_packed.main, "cuda"), (dpo_packed.main, "cuda:1")):
        with pytest.raises(SystemExit):
            main(["--device", device])
        err = capsys.readouterr().err
        assert f"--device {device}: CUDA is not available" in err and "--device cpu" in err, err
    with pytest.raises(SystemExit):
        sft_packed.main(["--device", "gpu"])
    assert "--device gpu: not a device name" in capsys.readouterr().err


def test_shipped_data_is_what_the_generator_writes(tmp_path):
    from training_examples.data import make_data

    make_data.main(str(tmp_path))
    for name in ("sft.jsonl", "dpo.jsonl"):
        with open(tmp_path / name) as a, open(os.path.join(EXAMPLES, "data", name)) as b:
            assert a.read() == b.read(), name
