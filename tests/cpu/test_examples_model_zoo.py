"""The training examples with ``--model PATH`` of a local Hugging Face model of each family of
tests/model_zoo.py (saved with the byte-level tokenizer): SFT runs, and its chunked LM-head loss
equals the model's own (``--loss-chunk 0``: Gemma 2's final logit soft-capping included); DPO runs
on the families with soft-capping and sinks; GPT-OSS's experts in chunks (``--mlp-chunk``); SFT of
the families with sliding layers under context parallelism (two processes) equals one process's."""
import math

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("datasets")

from tests import model_zoo  # noqa: E402
from training_examples import byte_tokenizer, dpo_packed, sft_packed  # noqa: E402

COMMON = ["--device", "cpu", "--log-every", "1", "--progress", "off", "--max-length", "96", "--batch-size", "1",
          "--steps", "2"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """family -> a directory with the family's small random model and the byte-level tokenizer."""
    import flashmask.integrations.transformers as fm_hf

    out = {}

    def get(family, **config):
        if not model_zoo.has_family(transformers, family):
            pytest.skip(f"this transformers has no {family}")
        key = (family,) + tuple(sorted(config.items()))
        if key not in out:
            d = tmp_path_factory.mktemp(family)
            model = model_zoo.make_model(transformers, family, fm_hf.ATTN_IMPLEMENTATION,
                                         vocab_size=byte_tokenizer.VOCAB_SIZE, pad_token_id=byte_tokenizer.PAD,
                                         bos_token_id=byte_tokenizer.BOS, eos_token_id=byte_tokenizer.EOS, **config)
            model.save_pretrained(d)
            byte_tokenizer.byte_tokenizer().save_pretrained(d)
            out[key] = str(d)
        return out[key]

    return get


@pytest.mark.parametrize("family", list(model_zoo.FAMILIES))
def test_sft_with_a_local_model_of_each_family(family, saved):
    chunked = sft_packed.main(COMMON + ["--model", saved(family), "--loss-chunk", "32"])
    own = sft_packed.main(COMMON + ["--model", saved(family), "--loss-chunk", "0"])
    assert len(chunked["losses"]) == 2 and all(math.isfinite(x) for x in chunked["losses"])
    assert chunked["losses"] == pytest.approx(own["losses"], rel=1e-4)


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_dpo_with_a_local_model_with_softcap_or_sinks(family, saved):
    # A window longer than the rows, as the real models' (4096, 128) against short triples: a
    # share-question layout whose positions jump inside a window has no column-interval form (raises).
    res = dpo_packed.main(COMMON + ["--model", saved(family, sliding_window=128)])
    assert abs(res["losses"][0] - math.log(2)) < 1e-3  # policy == reference at the first step
    assert all(math.isfinite(x) for x in res["losses"])


def test_sft_gpt_oss_experts_in_chunks_give_the_same_losses(saved):
    whole = sft_packed.main(COMMON + ["--model", saved("gpt_oss")])
    chunked = sft_packed.main(COMMON + ["--model", saved("gpt_oss"), "--mlp-chunk", "16"])
    assert chunked["losses"] == pytest.approx(whole["losses"], rel=1e-4)


def test_the_run_line_names_the_kernels_for_every_family(monkeypatch):
    import torch

    import flashmask
    from training_examples.models import backend_note

    monkeypatch.setattr(flashmask.cuda, "available", lambda: True)  # as on a GPU with the kernels built
    assert backend_note(torch.device("cuda"), torch.bfloat16) == "flashmask CUDA kernels"
    assert backend_note(torch.device("cpu"), torch.float32) == "flashmask reference path (pure PyTorch)"


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma3", "gpt_oss", "llama4"])
def test_sft_cp2_with_sliding_layers_equals_one_process(family, saved, tmp_path):
    # The sliding layers' window (tests/model_zoo.WINDOW tokens), and Llama 4's chunks
    # (tests/model_zoo.CHUNK), under context parallelism: the fm_cp backend runs them on each batch's
    # windowed or chunked plan (the chunks counted from each document's first token on both sides:
    # the collator's document mask gives the one-process backend the documents).
    from tests.cpu.test_examples_cp import csv_column, torchrun

    args = COMMON + ["--model", saved(family), "--cp-align", "8"]
    ref = sft_packed.main(args + ["--output-dir", str(tmp_path / "one")])["losses"]
    torchrun("training_examples.sft_packed", 2, args + ["--cp", "2", "--output-dir", str(tmp_path / "cp")])
    assert csv_column(tmp_path / "cp") == pytest.approx(ref, rel=1e-4)
