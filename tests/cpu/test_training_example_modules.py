"""The pieces of the training examples: data loading, the resumable stream, smoothed tokens/s,
the byte tokenizer and prompt formatting."""
import json
import sys

import pytest
import torch

pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

from training_examples import byte_tokenizer  # noqa: E402
from training_examples.checkpoints import TRAINER_STATE, find_checkpoint  # noqa: E402
from training_examples.models import MODEL_SIZES  # noqa: E402
from training_examples.packing import PackedStream  # noqa: E402
from training_examples.parallel import Parallel  # noqa: E402
from training_examples.prompts import answer_ids, prompt_ids  # noqa: E402
from training_examples.records import DataError, load_records  # noqa: E402
from training_examples.train_log import Throughput, rate_str  # noqa: E402

ROWS = [{"instruction": f"What is {i} + 1?", "response": f"{i + 1}.", "extra": i} for i in range(7)]


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "csv"])
def test_load_records_from_files(tmp_path, fmt):
    path = str(tmp_path / f"data.{fmt}")
    if fmt == "jsonl":
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in ROWS)
    elif fmt == "json":
        with open(path, "w") as f:
            json.dump(ROWS, f)
    else:
        ds = datasets.Dataset.from_list(ROWS)
        ds.to_parquet(path) if fmt == "parquet" else ds.to_csv(path, index=False)
    got = load_records(path, ["instruction", "response"])
    assert got == [{"instruction": r["instruction"], "response": r["response"]} for r in ROWS]
    assert len(load_records(path, ["instruction"], max_samples=3)) == 3


@pytest.mark.parametrize("fmt", ["jsonl", "json"])
def test_load_records_without_datasets(tmp_path, monkeypatch, fmt):
    """JSON files still load where `datasets` is not installed, exactly as with it; other formats say
    what to install."""
    path = str(tmp_path / f"data.{fmt}")
    with open(path, "w") as f:
        if fmt == "jsonl":
            f.writelines(json.dumps(r) + "\n" for r in ROWS)
        else:
            json.dump(ROWS, f)
    with_datasets = load_records(path, ["instruction", "response"], max_samples=5)
    datasets.Dataset.from_list(ROWS).to_parquet(str(tmp_path / "data.parquet"))
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` now raises ImportError
    assert load_records(path, ["instruction", "response"], max_samples=5) == with_datasets
    with pytest.raises(ValueError, match="no field 'answer'"):
        load_records(path, ["answer"])
    with pytest.raises(ImportError, match="pip install datasets"):
        load_records(str(tmp_path / "data.parquet"), ["response"])


BROKEN = {  # file name -> (its text, what the error names)
    "lines.jsonl": ('{"instruction": "a", "response": "b"}\n\n{"instruction": "c", "response": \n',
                    "line 3: not valid JSON"),
    "array.json": ('[{"instruction": "a", "response": "b"},\n {"instruction": "c" "response": "d"}]\n',
                   "line 2: not valid JSON"),
    "list.jsonl": ('{"instruction": "a", "response": "b"}\n["c", "d"]\n', "line 2: a JSON list, expected an object"),
    "bytes.jsonl": ('{"instruction": "a", "response": "b"}\n{"instruction": "\udcff", "response": "d"}\n',
                    "line 2: not UTF-8 text"),
}


@pytest.mark.parametrize("with_datasets", [True, False])
@pytest.mark.parametrize("name", sorted(BROKEN))
def test_malformed_json_names_the_file_and_the_line(tmp_path, monkeypatch, name, with_datasets):
    text, what = BROKEN[name]
    path = tmp_path / name
    path.write_bytes(text.encode("utf-8", "surrogateescape"))
    if not with_datasets:
        monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(DataError) as e:
        load_records(str(path), ["instruction", "response"])
    assert str(e.value).startswith(f"--data {path}: {what}"), str(e.value)


def test_load_records_glob_and_missing_field(tmp_path):
    for k in range(2):
        datasets.Dataset.from_list(ROWS[k * 3:(k + 1) * 3]).to_parquet(str(tmp_path / f"part{k}.parquet"))
    assert len(load_records(str(tmp_path / "part*.parquet"), ["response"])) == 6
    assert len(load_records(str(tmp_path), ["response"])) == 6  # a directory of data files
    with pytest.raises(ValueError, match=r"no field 'answer'; its fields are \['instruction', 'response', 'extra'\]"):
        load_records(str(tmp_path / "part0.parquet"), ["instruction", "answer"])


def test_load_records_by_dataset_name(monkeypatch):
    """A name that is not a local path goes to datasets.load_dataset with the config and split."""
    seen = {}

    def fake(name, config=None, split=None, **kw):
        seen.update(name=name, config=config, split=split)
        return datasets.Dataset.from_list(ROWS)

    monkeypatch.setattr(datasets, "load_dataset", fake)
    got = load_records("someone/some-pairs", ["response"], split="train[:10]", config="en")
    assert seen == {"name": "someone/some-pairs", "config": "en", "split": "train[:10]"} and len(got) == 7

    def offline(*a, **k):
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(RuntimeError, match="not a local file or directory.*offline"):
        load_records("someone/some-pairs", ["response"])


def test_packed_stream_resumes_where_it_stood():
    items = [[0] * n for n in (3, 5, 2, 7, 4, 6, 1, 20)]  # 20 > max_length: skipped
    a = PackedStream(items, len, 10, seed=3)
    assert a.dropped == 1
    first = a.rows(5)
    assert all(sum(map(len, row)) <= 10 and row for row in first)
    state = a.state_dict()
    rest = a.rows(7)  # crosses into later epochs
    b = PackedStream(items, len, 10, seed=3)
    b.load_state_dict(state)
    assert b.rows(7) == rest
    with pytest.raises(ValueError, match="no sample fits"):
        PackedStream([[0] * 11], len, 10, seed=0)


def test_rates_are_per_gpu_or_per_process():
    one, cpu = Parallel(), Parallel(rank=0, world=2, cp=2, device_type="cpu")
    gpu = Parallel(rank=0, world=2, cp=2, device_type="cuda")
    assert rate_str(3000.0, one) == "3,000 tokens/s"
    assert rate_str(3000.0, cpu) == "1,500 tokens/s/process (3,000 in all)"
    assert rate_str(3000.0, gpu) == "1,500 tokens/s/GPU (3,000 in all)"


def test_throughput_is_smoothed_and_skips_warm_up():
    m = Throughput(window=4)
    m.update(1000, 5.0)  # the first step pays for warm-up
    assert m.rate() == pytest.approx(200)
    for k in range(8):  # alternating fast and slow steps of 1000 tokens
        m.update(1000, 0.05 if k % 2 else 0.95)
    assert m.rate() == pytest.approx(4000 / 2.0)  # the last 4 steps: 4000 tokens in 2 s


def test_byte_tokenizer_ids_are_bytes_and_it_round_trips(tmp_path):
    from transformers import AutoTokenizer

    tok = byte_tokenizer.byte_tokenizer()
    text = "Héllo, wörld: 7 + 3 = 10\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == list(text.encode("utf-8"))
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (256, 257, 258)
    assert tok.decode(ids + [258], skip_special_tokens=True) == text
    tok.save_pretrained(str(tmp_path))
    again = AutoTokenizer.from_pretrained(str(tmp_path))
    assert again(text, add_special_tokens=False)["input_ids"] == ids and again.eos_token_id == 258


def test_prompt_uses_the_chat_template_when_there_is_one():
    tok = byte_tokenizer.byte_tokenizer()
    plain = prompt_ids(tok, "hi")
    assert plain == [257] + list(b"User: hi\nAssistant: ")
    tok.chat_template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    assert bytes(prompt_ids(tok, "hi")) == b"<user>hi<assistant>"
    assert prompt_ids(tok, "hi", use_chat_template=False) == plain
    assert answer_ids(tok, "ok") == list(b"ok") + [258]


def test_find_checkpoint_takes_the_latest(tmp_path):
    for step in (2, 10, 9):
        d = tmp_path / f"checkpoint-{step}"
        d.mkdir()
        torch.save({}, d / TRAINER_STATE)
    (tmp_path / "checkpoint-11").mkdir()  # no trainer state: not a checkpoint
    assert find_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-10")
    assert find_checkpoint(str(tmp_path / "checkpoint-2")) == str(tmp_path / "checkpoint-2")
    with pytest.raises(FileNotFoundError):
        find_checkpoint(str(tmp_path / "checkpoint-11"))


def test_model_presets_have_the_published_shapes():
    """(hidden, intermediate, layers, heads, KV heads): heads divide the hidden size and KV heads the
    heads (GQA); the presets named after a model have its head dim (0.5b and 1b: 64, 3b: 128)."""
    for name, (hidden, inter, layers, heads, kv) in MODEL_SIZES.items():
        assert hidden % heads == 0 and heads % kv == 0 and layers > 0 and inter > hidden, name
    head_dim = {name: s[0] // s[3] for name, s in MODEL_SIZES.items()}
    assert (head_dim["0.5b"], head_dim["1b"], head_dim["3b"]) == (64, 64, 128)
