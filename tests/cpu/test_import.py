"""What ``import flashmask`` costs and exposes: no torch._dynamo at import (torch.compile still
traces through flashmask_attention), ``flashmask.masks`` as a module path, and help(flashmask)."""
import importlib
import os
import re
import subprocess
import sys

import pytest
import torch

import flashmask
import masks
from tests import ROOT


def _python(code: str) -> str:
    """Run ``code`` in a fresh interpreter from the checkout's root; its stdout."""
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


def test_import_flashmask_leaves_torch_dynamo_unimported():
    out = _python("import sys, flashmask; print(flashmask.__file__); print('torch._dynamo' in sys.modules)")
    path, dynamo = out.split()
    assert path == os.path.join(ROOT, "flashmask", "__init__.py")
    assert dynamo == "False", "import flashmask must not import torch._dynamo (seconds on a CPU)"


@pytest.mark.slow
def test_import_flashmask_adds_little_to_import_torch():
    """``import torch`` vs ``import torch, flashmask``: the increment, best of 3 fresh interpreters."""
    code = ("import time; t0 = time.perf_counter(); import torch; t1 = time.perf_counter(); import flashmask; "
            "print(time.perf_counter() - t1, t1 - t0)")
    runs = [tuple(float(x) for x in _python(code).split()) for _ in range(3)]
    extra = min(r[0] for r in runs)
    assert extra < 1.0, f"import flashmask adds {extra:.2f} s to import torch ({min(r[1] for r in runs):.2f} s)"


@pytest.mark.parametrize("statement, check", [
    ("import flashmask.masks", "flashmask.masks is masks and flashmask.masks.causal_document is masks.causal_document"),
    ("from flashmask.masks import causal_document", "causal_document is masks.causal_document"),
    ("from flashmask.masks.packed import from_starts", "from_starts is masks.packed.from_starts"),
])
def test_flashmask_masks_is_a_module_path(statement, check):
    """In a fresh interpreter (nothing imported yet): the top-level package itself, not a copy."""
    assert _python(f"{statement}\nimport flashmask, masks, masks.packed\nprint({check})").strip() == "True"


def test_flashmask_masks_in_this_process():
    mod = importlib.import_module("flashmask.masks")
    assert mod is masks is flashmask.masks


def test_help_lists_the_public_api():
    doc = flashmask.__doc__
    for name in flashmask.__all__:
        assert re.search(rf"\b{name}\b", doc), name
    sections = ["Attention", "Modules", "Masks", "Data", "Losses", "Checkpointing", "Integrations", "Distributed"]
    for section in sections:
        assert re.search(rf"^{section}\b", doc, re.M), section
    for module in re.findall(r"``(flashmask\.[a-z_.]+)``", doc):
        if module.endswith("transformers") or module.endswith(".hf"):
            pytest.importorskip("transformers")
        importlib.import_module(module)


@pytest.mark.slow
def test_torch_compile_fullgraph_traces_flashmask_attention():
    """The import of torch._dynamo is left to torch.compile, which still traces the whole call."""
    q, k, v = torch.randn(2, 16, 4, 8), torch.randn(2, 16, 2, 8), torch.randn(2, 16, 2, 8)
    mask = masks.causal_document(16, [7, 9], batch_size=2)

    def f(q, k, v):
        return flashmask.flashmask_attention(q, k, v, mask, causal=True, softmax_scale=0.5)

    compiled = torch.compile(f, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(q, k, v), f(q, k, v))
