"""scripts/sustained_power.py and scripts/host_jitter.py: the parts that need no GPU."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import host_jitter  # noqa: E402
import sustained_power  # noqa: E402


def test_parse_smi_keeps_whole_rows_only():
    lines = ["2026/11/24 13:31:47.483, 1815, 272.82\n", "2026/11/24 13:31:47.583, [N/A], 600\n",
             "2026/11/24 13:31:47.683, 1700, 6", "not a row"]
    samples = sustained_power.parse_smi(lines)
    assert [s[1:] for s in samples] == [(1815.0, 272.82), (1700.0, 6.0)]
    assert samples[1][0] - samples[0][0] == pytest.approx(0.2)


def test_window_means_average_the_samples_inside_only():
    samples = [(10.0, 1980.0, 100.0), (11.0, 1600.0, 700.0), (12.0, 1400.0, 680.0), (13.0, 1980.0, 90.0)]
    mhz, watts = sustained_power.window_means(samples, 10.5, 12.0)
    assert (mhz, watts) == (1500.0, 690.0)
    assert sustained_power.window_means(samples, 20.0, 30.0) is None


def test_slow_readings_name_the_outliers_with_their_host_time():
    readings = {"causal": [(0.28, 0.28, 0.06)] * 4 + [(0.97, 0.29, 0.31)],
                "full": [(0.57, 0.58, 0.08)] * 5,
                "document": [(0.16, 0.16, 0.06)] * 4 + [(0.16, 0.29, 0.28)]}
    lines = host_jitter.slow_readings(readings)
    assert len(lines) == 2
    assert lines[0].startswith("causal pass 4: do_bench 0.970 ms") and lines[0].endswith("host 0.310 ms per call")
    assert lines[1].startswith("document pass 4:") and "back to back 0.290" in lines[1]


@pytest.mark.parametrize("argv", [["--seconds", "0"], ["--seconds", "1", "--skip", "1"], ["--settle", "-1"]])
def test_sustained_power_refuses_empty_windows(argv, capsys):
    with pytest.raises(SystemExit):
        sustained_power.main(argv)
    assert "need --seconds > 0" in capsys.readouterr().err


@pytest.mark.parametrize("argv,name", [(["--passes", "0"], "passes"), (["--calls", "0"], "calls")])
def test_host_jitter_refuses_zero_counts(argv, name, capsys):
    with pytest.raises(SystemExit):
        host_jitter.main(argv)
    assert f"--{name} must be at least 1, got 0" in capsys.readouterr().err
