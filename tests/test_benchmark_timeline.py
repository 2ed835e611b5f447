"""``benchmarks/harness.gpu_timeline``: the idle time and the host ops behind it, from intervals."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import harness  # noqa: E402


def test_idle_gaps_and_the_host_ops_that_spanned_them() -> None:
    # kernels (us): two overlapping, then a 3 ms gap, then one more after a 0.5 ms gap
    kernels = [(0.0, 1000.0), (500.0, 2000.0), (5000.0, 6000.0), (6500.0, 7000.0)]
    host = [
        ("aten::copy_", 1500.0, 5200.0),  # spans the 3 ms gap
        ("cudaStreamSynchronize", 2100.0, 4900.0),  # inside it, shorter
        ("aten::mm", 0.0, 100.0),  # before it
        ("whole step", 0.0, 9e6),  # longer than 5 s: a parent, not a cause
    ]
    out = harness.gpu_timeline(kernels, host)
    assert out["kernels"] == 4
    assert out["span_s"] == 0.007 and out["gpu_busy_s"] == 0.0035 and out["idle_s"] == 0.0035
    assert out["gaps_over_1ms"] == 1 and out["gaps_over_1ms_s"] == 0.003
    longest, second = out["longest_gaps"]
    assert longest == {"gap_ms": 3.0, "host_ops": ["aten::copy_", "cudaStreamSynchronize"]}
    assert second == {"gap_ms": 0.5, "host_ops": []}
    assert harness.gpu_timeline([], host) == {"kernels": 0}
