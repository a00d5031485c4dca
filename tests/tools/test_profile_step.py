"""tools/profile_step.py: arguments it cannot honour end it before any tensor is made (no GPU needed)."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("args, message", [
    (["--family", "causal_document", "--sdpa-cudnn"], "need --family causal or full, got causal_document"),
    (["--family", "document", "--no-mask"], "need --family causal or full, got document"),
    (["--sdpa-cudnn", "--deterministic"], "--deterministic is flashmask's"),
    (["--heads", "16", "--kv-heads", "5"], "--kv-heads must divide --heads (16), got 5"),
])
def test_bad_arguments_are_refused(args, message):
    r = subprocess.run([sys.executable, "-m", "tools.profile_step", *args], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 2
    assert message in r.stderr
