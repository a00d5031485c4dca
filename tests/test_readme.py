"""The README's CPU example runs as written, and the README points at the format contract."""
import os
import re

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme():
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def test_cpu_example_runs_and_backpropagates():
    m = re.search(r"The same on a CPU.*?```python\n(.*?)```", _readme(), re.S)
    assert m, "README has no CPU example"
    code = m.group(1)
    assert "cuda" not in code
    scope = {}
    exec(compile(code, "README.md (CPU example)", "exec"), scope)
    out, q = scope["out"], scope["q"]
    assert out.shape == q.shape and out.device.type == "cpu"
    assert q.grad is not None and torch.isfinite(q.grad).all() and q.grad.abs().sum() > 0


def test_readme_links_exist():
    for target in re.findall(r"\]\(((?:docs|training_examples)/[^)#]+)\)", _readme()) + ["LICENSE"]:
        assert os.path.exists(os.path.join(ROOT, target)), target
