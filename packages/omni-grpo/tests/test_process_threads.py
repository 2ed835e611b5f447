"""Intra-op threads: one on CPU runs (tiny ops, oversubscribed machines), torch's own on GPU runs
(their CPU work, media and packing, feeds the GPU)."""

from __future__ import annotations

import pytest
import torch
from omni_grpo.run.process import configure_threads


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield before
    torch.set_num_threads(before)


def test_cpu_runs_get_one_thread_gpu_runs_keep_torchs(
    threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OMNI_GRPO_TORCH_THREADS", raising=False)
    torch.set_num_threads(2)
    configure_threads("cuda")
    assert torch.get_num_threads() == 2
    configure_threads("cpu")
    assert torch.get_num_threads() == 1
    torch.set_num_threads(2)
    configure_threads("auto")  # a GPU run only where torch sees one
    assert torch.get_num_threads() == (2 if torch.cuda.is_available() else 1)


def test_the_variable_sets_threads_on_any_device(
    threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMNI_GRPO_TORCH_THREADS", "2")
    torch.set_num_threads(1)
    configure_threads("cuda")
    assert torch.get_num_threads() == 2
