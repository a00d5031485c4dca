"""The README's CPU example runs as written, its CI commands are CI's, and the documents' relative links resolve."""
import os
import re

import pytest
import torch

from tests import ROOT

# The user and performance documents whose relative links must point at files of the checkout.
DOCUMENTS = ["README.md", "CHANGELOG.md", "benchmarks/README.md", "docs/format.md", "docs/performance.md",
             "docs/context_parallel.md", "docs/masks/README.md", "docs/dev/history.md", "docs/dev/perf_notes.md"]


def _read(path):
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


def _readme():
    return _read("README.md")


def _relative_links(text):
    """(path, anchor) of markdown links and images that are not URLs; path "" for an in-page anchor."""
    links = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if not re.match(r"[a-z]+:", target):
            path, _, anchor = target.partition("#")
            links.append((path, anchor))
    return links


def _anchors(text):
    """GitHub's anchors of a markdown text's headings: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.*)$", text, re.M)}


@pytest.mark.slow
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
    targets = re.findall(r"\]\(((?:docs|training_examples)/[^)#]+)\)", _readme()) + ["LICENSE"]
    assert "docs/format.md" in targets
    for target in targets:
        assert os.path.exists(os.path.join(ROOT, target)), target


def test_readme_has_the_commands_ci_runs():
    # .ci/run names the README section of each command it runs; the README must show them verbatim.
    lines = _read(".ci/run").splitlines()
    commands = [lines[i + 1].strip() for i, line in enumerate(lines) if line.startswith("# README")]
    assert len(commands) == 2, commands
    for command in commands:
        assert command in _readme(), command


def test_document_links_resolve():
    for doc in DOCUMENTS:
        base = os.path.dirname(os.path.join(ROOT, doc))
        for path, anchor in _relative_links(_read(doc)):
            target = os.path.normpath(os.path.join(base, path)) if path else os.path.join(ROOT, doc)
            assert os.path.exists(target), f"{doc}: {path}"
            if anchor and target.endswith(".md"):
                with open(target) as f:
                    assert anchor in _anchors(f.read()), f"{doc}: {path}#{anchor}"
