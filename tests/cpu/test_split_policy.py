"""The split-KV count (csrc/api/split_policy.h) compiled on the CPU: the fewest block-times of a
wave-quantised launch, no count that leaves a few jobs to a wave of their own."""
import itertools
import subprocess

import pytest

from tests.cxx import build

DRIVER = r"""
#include <cstdio>
#include "api/split_policy.h"
int main() {
    int tiles, blocks, resident;
    while (std::scanf("%d %d %d", &tiles, &blocks, &resident) == 3)
        std::printf("%d\n", flashmask::split_kv_count(tiles, blocks, resident));
}
"""

CASES = list(itertools.product([1, 3, 8, 32, 64, 100, 131, 132, 500], [1, 7, 8, 31, 64, 257, 1024, 4096],
                               [132, 264]))


@pytest.fixture(scope="module")
def counts(tmp_path_factory):
    exe = build(DRIVER, tmp_path_factory.mktemp("split_policy"), "driver")
    text = "".join(f"{t} {b} {r}\n" for t, b, r in CASES)
    run = subprocess.run([str(exe)], input=text, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return dict(zip(CASES, map(int, run.stdout.split())))


def block_times(tiles, blocks, resident, s):
    return -(-tiles * s // resident) * -(-blocks // s)


def test_the_count_is_the_smallest_within_five_percent_of_the_fewest_block_times(counts):
    for (tiles, blocks, resident), s in counts.items():
        if tiles >= resident or blocks < 8:
            assert s == 1, (tiles, blocks, resident)
            continue
        most = min(64, blocks // 4)
        assert 1 <= s <= most
        times = {c: block_times(tiles, blocks, resident, c) for c in range(1, most + 1)}
        best = min(times.values())
        assert times[s] <= 1.05 * best, (tiles, blocks, resident, s)
        assert all(times[c] > 1.05 * best for c in range(1, s)), (tiles, blocks, resident, s)


def test_decoding_and_chunked_prefill_fill_one_wave(counts):
    """132 SMs, one CTA each (the SM90 forward), 1024 key blocks: 8 tiles (one sequence's 8 kv heads,
    its GQA groups folded) split 16 ways, not 17 (136 jobs: 4 in a second wave); 32 tiles 4 ways,
    not 5; 64 tiles 2 ways, not 3."""
    assert counts[(8, 1024, 132)] == 16
    assert counts[(32, 1024, 132)] == 4
    assert counts[(64, 1024, 132)] == 2
    assert counts[(8, 1024, 264)] == 32
    assert counts[(8, 64, 132)] == 16  # 4 key blocks a split at most
    assert counts[(132, 4096, 132)] == 1 and counts[(8, 7, 132)] == 1

