"""The repository speaks of the product: no words about the machines, tools or process it was
developed with (they mean nothing to a user and go stale)."""
import os
import re

from tests import ROOT

# Phrases that describe how the project was developed rather than what it is.
# Written with \s+ so that this file does not itself hold the phrases it looks for.
FORBIDDEN = re.compile(
    r"device\s+tool|\blead[']s\b|the\s+(h100|h200|gpu)\s+(machine|box)|\bthis\s+session\b|\bsession\s+\d+|"
    r"\bthe\s+issue\b(?! slots?)|carried\s+wheels?|\bdevice_out\b",
    re.IGNORECASE,
)
SKIP_DIRS = {"build", "dist", "runs", "__pycache__", "node_modules"}
HIDDEN_KEPT = {".ci", ".github"}  # other dot-folders are git's, caches or local environments
BINARY = (".png", ".jpg", ".so", ".whl", ".pyc", ".o", ".pdf")
HERE = os.path.abspath(__file__)


def _text_files():
    for top, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")
                   and (not d.startswith(".") or d in HIDDEN_KEPT)]
        for name in files:
            path = os.path.join(top, name)
            if not name.endswith(BINARY) and os.path.abspath(path) != HERE:
                yield path


def test_no_development_environment_wording():
    hits = []
    for path in _text_files():
        try:
            with open(path, encoding="utf-8") as f:
                for number, line in enumerate(f, 1):
                    if FORBIDDEN.search(line):
                        hits.append(f"{os.path.relpath(path, ROOT)}:{number}: {line.strip()[:120]}")
        except UnicodeDecodeError:
            continue
    assert not hits, "development-environment wording:\n" + "\n".join(hits)


def test_the_pattern_catches_what_it_should():
    for phrase in ("run it with the device  tool", "the lead" + "'s box", "on the H100  machine", "in session  24"):
        assert FORBIDDEN.search(phrase), phrase
    for phrase in ("an H100 GPU", "the tile scheduler's ticket", "issue S = Q K^T", "the" + " issue slots"):
        assert not FORBIDDEN.search(phrase), phrase
