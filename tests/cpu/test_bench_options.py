"""benchmarks/bench_options.py: its arguments and the ratios it reports (the timing itself needs a GPU)."""
import pytest

from benchmarks import bench_options


def test_defaults_and_bad_arguments():
    a = bench_options.parse_args([])
    assert a.families == ["full", "causal", "causal_document"] and a.head_dims == [64, 128, 256]
    assert a.seqlens == [8192, 32768] and a.softcap == 50.0 and a.passes == 2
    for bad in (["--softcap", "0"], ["--softcap", "nan"], ["--passes", "0"], ["--families", "nope"]):
        with pytest.raises(SystemExit):
            bench_options.parse_args(bad)


def test_ratios_compare_each_pass_with_its_own_plain_call():
    rows = []
    for pass_, plain, capped in ((1, 2.0, 3.0), (2, 4.0, 5.0)):
        for option, ms in (("plain", plain), ("softcap", capped), ("sinks", plain)):
            rows.append(dict(pass_=pass_, head_dim=64, seqlen=8192, family="causal", option=option, mode="fwd", ms=ms))
    got = {(r[3], r[4]): r[5] for r in bench_options.ratios(rows)}
    assert got == {("softcap", "fwd"): [1.5, 1.25], ("sinks", "fwd"): [1.0, 1.0]}


def test_options_reach_flashmask():
    sinks = object()
    assert bench_options.option_kwargs("plain", 50.0, sinks) == {}
    assert bench_options.option_kwargs("softcap", 50.0, sinks) == {"softcap": 50.0}
    assert bench_options.option_kwargs("sinks", 50.0, sinks) == {"sinks": sinks}
