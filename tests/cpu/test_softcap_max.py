"""Where a soft-capped softmax runs at a fixed max (csrc/common/softcap_max.h), compiled on the CPU: at
every cap it allows, the exponentials of scores anywhere in [-softcap, softcap] stay normal floats at
most 2^64, and it allows every cap up to 65.8 (Gemma 2's 50, Grok's 30) and none above."""
import math
import subprocess

import numpy as np
import pytest

from tests.cxx import build

DRIVER = r"""
#include <cstdio>
#include "common/softcap_max.h"
int main() {
    float c;
    while (std::scanf("%f", &c) == 1) std::printf("%.9g\n", flashmask::softcap_fixed_max(c));
}
"""

CAPS = [0.01, 1.0, 5.0, 20.0, 30.0, 44.0, 44.5, 50.0, 60.0, 65.0, 65.8, 65.9, 66.0, 80.0, 200.0, 1e4]


@pytest.fixture(scope="module")
def fixed_max(tmp_path_factory):
    exe = build(DRIVER, tmp_path_factory.mktemp("softcap_max"), "driver")
    # The binding passes scale_log2 = softcap * log2(e) in float32.
    scale_log2 = [float(np.float32(c * math.log2(math.e))) for c in CAPS]
    run = subprocess.run([str(exe)], input="".join(f"{s:.9g}\n" for s in scale_log2), capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return {cap: (s, float(m)) for cap, s, m in zip(CAPS, scale_log2, run.stdout.split())}


def test_caps_up_to_65_8_run_at_a_fixed_max(fixed_max):
    for cap, (_, m) in fixed_max.items():
        assert (m >= 0) == (cap <= 65.8), (cap, m)


def test_the_exponentials_of_every_capped_score_stay_in_range(fixed_max):
    """exp2(t * C - shift) for t in [-1, 1], as the kernels compute it in float32: the smallest a
    normal float (no flush to zero), the largest at most 2^64, so that a row's sum over 2^22 keys of
    values up to 2^40 stays finite."""
    t = np.linspace(-1, 1, 2001, dtype=np.float32)
    for cap, (c, m) in fixed_max.items():
        if m < 0:
            continue
        shift = np.float32(m) * np.float32(c)
        e = np.exp2(t * np.float32(c) - shift)
        assert e.min() >= np.finfo(np.float32).tiny, (cap, e.min())
        assert e.max() <= 2.0**64 * (1 + 1e-5), (cap, e.max())
        assert np.isfinite(np.float32(e.max()) * np.float32(2**22) * np.float32(2**40)), cap


def test_small_caps_are_not_shifted(fixed_max):
    """Up to softcap 44.36 (C = 64) the exponentials are exp(t * softcap) themselves."""
    assert all(m == 0 for cap, (_, m) in fixed_max.items() if cap <= 44.0)
    assert fixed_max[50.0][1] > 0
