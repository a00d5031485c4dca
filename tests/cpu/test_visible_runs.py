"""The per-row key counts of the CUDA forward on the CPU: ``visible_runs`` (csrc/mask/intervals.h),
which gives each key column's runs of query rows that may attend it, compiled with a C++ compiler,
summed over the columns as the forward's key_count_steps_kernel does, and compared with the dense
mask of ``masks.to_dense``. A row counted 0 is one the kernels treat as hidden (output 0, LSE +inf);
any other row that ends empty gives NaN. Every (causal, C) mode, Sq != Sk, overlapping intervals
and values outside [0, Sq], which compare as if clamped.
"""
from __future__ import annotations

import pytest
import torch

from masks.format import to_dense
from tests.attn_helpers import random_startend
from tests.cxx import build, run_on_mask

MODES = [(True, 1), (True, 2), (False, 2), (False, 4)]

# stdin: slices sq sk c causal, then each slice's [Sk, C] values; stdout: each slice's Sq counts.
DRIVER = r"""
#define __host__
#define __device__
#define __forceinline__ inline
#include <cstdio>
#include <vector>
#include "mask/intervals.h"
int main() {
    int slices, sq, sk, c, causal;
    if (std::scanf("%d %d %d %d %d", &slices, &sq, &sk, &c, &causal) != 5) return 1;
    std::vector<int> col(size_t(sk) * c);
    for (int s = 0; s < slices; ++s) {
        for (int& x : col) std::scanf("%d", &x);
        std::vector<long> steps(sq + 1, 0);
        for (int j = 0; j < sk; ++j) {
            int lo[3], hi[3];
            const int runs = flashmask::visible_runs(flashmask::read_column(col.data(), j, c, causal, sq), j, causal,
                                                     sq, sk, lo, hi);
            for (int t = 0; t < runs; ++t) ++steps[lo[t]], --steps[hi[t]];
        }
        long seen = 0;
        for (int i = 0; i < sq; ++i) std::printf("%ld ", seen += steps[i]);
        std::printf("\n");
    }
}
"""


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    return build(DRIVER, tmp_path_factory.mktemp("visible_runs"), "driver")


def key_counts(exe, mask: torch.Tensor, causal: bool, sq: int) -> torch.Tensor:
    """[B, Hm, Sq]: the keys each row may attend, by visible_runs."""
    b, hm = mask.shape[:2]
    return torch.tensor([[int(x) for x in line.split()] for line in run_on_mask(exe, mask, sq, causal)]).view(b, hm, sq)


@pytest.mark.parametrize("causal,c", MODES)
@pytest.mark.parametrize("sq,sk", [(37, 37), (23, 61), (61, 23), (1, 9), (9, 1)])
def test_counts_match_the_dense_mask(driver, sq, sk, causal, c):
    gen = torch.Generator().manual_seed(sq * 1000 + sk * 10 + c + 5 * causal)
    mask = random_startend(3, 2, sq, sk, causal, c, generator=gen)
    # Values off [0, Sq] on some columns: the kernels compare them as if clamped.
    off = torch.rand(mask.shape, generator=gen) < 0.1
    wild = torch.randint(-5, sq + 6, mask.shape, generator=gen, dtype=torch.int32)
    mask = torch.where(off, wild, mask)
    want = to_dense(mask, causal, seqlen_q=sq, seqlen_k=sk).sum(-1)
    got = key_counts(driver, mask, causal, sq)
    assert torch.equal(got, want)


def test_rows_hidden_by_intervals_that_overlap(driver):
    """Non-causal C=4 whose two intervals overlap, nest, touch or come in either order: each column
    hides rows [2, 7) in all, so those rows see no key and the others see all four."""
    cols = torch.tensor([[2, 5, 4, 7], [2, 7, 3, 4], [3, 7, 2, 3], [2, 4, 4, 7]], dtype=torch.int32)
    mask = cols.view(1, 1, 4, 4)
    got = key_counts(driver, mask, False, 9)
    assert got.flatten().tolist() == [4, 4, 0, 0, 0, 0, 0, 4, 4]
    assert torch.equal(got, to_dense(mask, False, seqlen_q=9).sum(-1))
