"""The GPU clock and power sampling of bench_kernels --gpu-clocks, with a stand-in for nvidia-smi."""
import sys

import pytest
import torch

from benchmarks import bench_kernels, gpu_clocks, methods, timing
from masks.examples import example


def fake_smi(lines, interval_s=0.01):
    """A command that prints ``lines`` (then the last one again) every ``interval_s``, as nvidia-smi -lms does."""
    script = (f"import time\nlines = {list(lines)!r}\ni = 0\n"
              f"while True:\n    print(lines[min(i, len(lines) - 1)], flush=True)\n    i += 1\n"
              f"    time.sleep({interval_s})\n")
    return [sys.executable, "-c", script]


def test_parse_samples_keeps_pairs_of_numbers_only():
    text = "1755, 689.12\n[N/A], 10\n\nFailed to initialize NVML\n1740, 690\n1, 2, 3\n"
    assert gpu_clocks.parse_samples(text) == [(1755.0, 689.12), (1740.0, 690.0)]


def test_steady_medians_leave_out_the_ramp():
    ramp = [(1980.0, 300.0)] * 2
    steady = [(1740.0, 690.0), (1755.0, 691.0), (1725.0, 689.0), (1740.0, 690.0), (1740.0, 692.0), (1755.0, 690.0)]
    assert gpu_clocks.steady_medians(ramp + steady) == (1740.0, 690.0)
    assert gpu_clocks.steady_medians([]) is None
    assert gpu_clocks.steady_medians([(1500.0, 400.0)]) == (1500.0, 400.0)


def test_clock_sampler_reads_the_samples_taken_during_the_block():
    import time
    with gpu_clocks.ClockSampler(command=fake_smi(["1980, 300"] * 3 + ["1700, 690"])) as sampler:
        assert sampler.result is None
        time.sleep(0.4)
    assert sampler.result == (1700.0, 690.0)


def test_clock_sampler_names_a_failing_command():
    cmd = [sys.executable, "-c", "import sys; sys.stderr.write('NVIDIA-SMI has failed'); sys.exit(9)"]
    with pytest.raises(RuntimeError, match="exited with status 9: NVIDIA-SMI has failed"):
        with gpu_clocks.ClockSampler(command=cmd):
            pass
    with pytest.raises(ValueError, match="needs a device or a command"):
        gpu_clocks.ClockSampler()


def test_try_time_returns_the_sampled_clock(monkeypatch):
    class Sampler:
        def __init__(self, device):
            self.result = None

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.result = (1650.0, 688.0)

    monkeypatch.setattr(timing, "ClockSampler", Sampler)
    cpu = torch.device("cpu")
    p = methods.Problem(example("causal", 32)[0], True, 1, 2, 16, 32, torch.float32, cpu)
    prep = methods.prepare_method("flashmask", p, methods.Options(flashmask_backend="reference"))
    tensors = timing.make_inputs(1, 32, 2, 16, torch.float32, cpu)
    res = timing.try_time(prep, "fwd", tensors, 100, 16, 0, 0, cpu, clocks=True)
    assert res["status"] == "ok" and (res["sm_mhz"], res["power_w"]) == (1650.0, 688.0)
    res = timing.try_time(prep, "fwd", tensors, 100, 16, 0, 0, cpu)
    assert res["sm_mhz"] is None and res["power_w"] is None


def test_bench_kernels_gpu_clocks_needs_a_cuda_device(capsys):
    with pytest.raises(SystemExit):
        bench_kernels.parse_args(["--gpu-clocks", "--device", "cpu"])
    assert "--gpu-clocks cannot sample here: --device is not a CUDA device" in capsys.readouterr().err


def test_bench_kernels_summary_shows_each_methods_clock():
    base = {"family": "full", "seqlen": 8192, "head_dim": 256, "head_dim_v": 256, "mode": "fwd", "status": "ok",
            "density": 1.0, "ms": 1.7, "tflops": 640.0}
    rows = [dict(base, method="flashmask_plain", sm_mhz=1620.0, power_w=691.0),
            dict(base, method="sdpa_cudnn", ms=1.68, tflops=650.0, sm_mhz=1680.0, power_w=689.0)]
    table = bench_kernels.summary_table(rows)
    header, line = table.splitlines()[0], table.splitlines()[-1]
    assert header.rstrip().endswith("plain MHz  cudnn MHz"), table
    assert line.rstrip().endswith("1620       1680"), table
    assert "MHz" not in bench_kernels.summary_table([dict(r, sm_mhz=None) for r in rows])
