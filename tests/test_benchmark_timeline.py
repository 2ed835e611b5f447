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


def test_kernels_are_cut_into_phases_at_the_marker_kernels() -> None:
    m = harness.MARKER_KERNEL
    kernels = [
        ("warm", 0.0, 1000.0),
        (f"void at::native::{m}(long)", 1000.0, 1001.0),
        ("gemm", 1001.0, 3001.0),
        ("gather", 3001.0, 3501.0),
        (m, 4000.0, 4001.0),
        ("gemm", 4001.0, 5001.0),
        (m, 6000.0, 6001.0),  # the reference again: its kernels add to the first occurrence's
        ("gemm", 6001.0, 7001.0),
    ]
    out = harness.phase_split(kernels, ["reference", "backward", "reference"])
    assert out["markers"] == 3
    assert out["phases"]["before"] == {"gpu_ms": 1.0, "kernels": 1, "top_ms": [["warm", 1.0]]}
    assert (
        out["phases"]["reference"]["gpu_ms"] == 3.5 and out["phases"]["reference"]["kernels"] == 3
    )
    assert out["phases"]["reference"]["top_ms"] == [["gemm", 3.0], ["gather", 0.5]]
    assert out["phases"]["backward"] == {"gpu_ms": 1.0, "kernels": 1, "top_ms": [["gemm", 1.0]]}


def test_phase_marks_label_the_calls_and_restore_the_functions(monkeypatch) -> None:
    import types

    import torch

    sleeps: list[int] = []
    monkeypatch.setattr(torch.cuda, "_sleep", sleeps.append)
    owner = types.SimpleNamespace(forward=lambda x: x + 1, backward=lambda: "b")
    original = owner.forward
    labels: list[str] = []
    gate = [False]
    with harness.phase_marks(
        labels, (owner, "forward", "fwd", lambda: gate[0]), (owner, "backward", "bwd", None)
    ):
        assert owner.forward(1) == 2 and labels == []  # when() false: no marker
        gate[0] = True
        assert owner.forward(1) == 2 and owner.backward() == "b"
    assert labels == ["fwd", "bwd"] and sleeps == [1, 1]
    assert owner.forward is original


def _waits_here(times: int) -> None:
    import warnings

    for _ in range(times):  # the warning torch's sync debug mode gives, from this line
        warnings.warn(f"called a {harness.SYNC_WARNING}", UserWarning, stacklevel=1)


def test_sync_sites_counts_each_wait_by_the_line_of_this_repository_that_asked() -> None:
    import warnings

    def step() -> str:
        _waits_here(3)
        warnings.warn("something else", UserWarning, stacklevel=1)  # not a sync: not counted
        return "done"

    out, sites = harness.sync_sites(step)
    assert out == "done"
    [(site, count)] = sites.items()
    assert (
        count == 3
        and site.startswith("tests/test_benchmark_timeline.py:")
        and "_waits_here" in site
    )
