"""The kernels' span test of the column intervals (csrc/mask/intervals.h, ``rows_masked``) against
their per-row test (``row_masked``), on the CPU: the header is plain C++ once CUDA's qualifiers are
defined away.

The SM90 forward skips or fills a quarter of a tile's keys on the span test's word (the element
compare by quarters), so a claim of "all rows masked" or "no row masked" must never be wrong; an
answer of neither is always safe. For one interval that is not empty the test must also be exact,
or the quarters would compare what they could leave out.
"""
from __future__ import annotations

import subprocess

from tests.cxx import build

PROGRAM = r"""
#define __host__
#define __device__
#define __forceinline__ inline
#include "mask/intervals.h"
#include <cstdio>
using namespace flashmask;

// Every value vector in [-2, 11]^C, every span [a, b] with 0 <= a <= 10, b - a < 6.
template <bool kCausal, int kC> int check() {
    int wrong = 0, inexact = 0, v[kC];
    long n = 1;
    for (int i = 0; i < kC; ++i) n *= 14;
    for (long code = 0; code < n; ++code) {
        long c = code;
        for (int i = 0; i < kC; ++i) { v[i] = int(c % 14) - 2; c /= 14; }
        for (int a = 0; a <= 10; ++a) {
            for (int b = a; b < a + 6; ++b) {
                bool all = true, none = true;
                for (int r = a; r <= b; ++r) {
                    const bool m = row_masked<kCausal, kC>(v, r);
                    all &= m;
                    none &= !m;
                }
                const RowSpanMask s = rows_masked<kCausal, kC>(v, a, b);
                wrong += (s.all && !all) || (s.none && !none);
                const bool one_interval = kCausal && (kC == 1 || v[0] < v[1]);
                inexact += one_interval && (s.all != all || s.none != none);
            }
        }
    }
    printf("%d %d %d %d\n", int(kCausal), kC, wrong, inexact);
    return wrong + inexact;
}

int main() {
    const int bad = check<true, 1>() + check<true, 2>() + check<false, 2>() + check<false, 4>();
    return bad == 0 ? 0 : 1;
}
"""


def test_span_test_agrees_with_the_row_test(tmp_path):
    exe = build(PROGRAM, tmp_path, "spans")
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    lines = run.stdout.split()
    assert len(lines) == 16, run.stdout  # four modes, four numbers each
    for causal, c, wrong, inexact in zip(*[iter(lines)] * 4):
        assert (wrong, inexact) == ("0", "0"), f"causal={causal} C={c}: {wrong} wrong, {inexact} inexact"
    assert run.returncode == 0
