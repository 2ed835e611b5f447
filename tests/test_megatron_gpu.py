"""GPU: the Megatron thinker against transformers, TP=2/EP=2 GRPO steps and bit-exact NCCL sync.

Wraps ``omni_grpo.testing.megatron.verify`` (which the device runs record) in assertions. Needs
CUDA and megatron-core (Python >= 3.12); the TP test needs two GPUs. Skips cleanly otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_two = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"
)


def _env(tmp: Path) -> dict[str, str]:
    pytest.importorskip("megatron.core")
    return {
        **os.environ,
        "NCCL_CUMEM_ENABLE": "0",
        "NCCL_NVLS_ENABLE": "0",
        "OMNI_VERIFY_DIR": str(tmp / "ckpt"),
    }


@needs_cuda
def test_parity_with_hf_thinker_audio_image_video_text(tmp_path: Path) -> None:
    out = tmp_path / "parity.json"
    subprocess.run(
        [sys.executable, "-m", "omni_grpo.testing.megatron.verify", "parity", str(out)],
        check=True,
        env=_env(tmp_path),
        timeout=600,
    )
    r = json.loads(out.read_text())
    for impl in ("grouped", "sequential"):
        assert r[f"fp32_{impl}_vs_hf_fp32"]["max_abs"] < 1e-5
        # bf16: no worse than transformers' own bf16 thinker against its fp32 run (x2 margin)
        assert r[f"bf16_{impl}_vs_hf_fp32"]["rel_l2"] < 2 * r["hf_bf16_vs_hf_fp32"]["rel_l2"] + 1e-3
    assert r["fp32_text_only_vs_hf_fp32"]["max_abs"] < 1e-5


@needs_two
def test_tp2_ep2_grpo_step_and_bit_exact_sync(tmp_path: Path) -> None:
    out = tmp_path / "tp.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "-m",
        "omni_grpo.testing.megatron.verify",
        "tp",
        str(out),
    ]
    subprocess.run(cmd, check=True, env=_env(tmp_path), timeout=900)
    r = json.loads(out.read_text())
    assert r["tp2_ep2_sp_logits_vs_hf_fp32"]["max_abs"] < 1e-5
    assert all(s["skipped_step"] == 0.0 and s["grad_norm"] > 0 for s in r["grpo_steps"])
    assert r["replicated_param_max_drift_across_ranks"] == 0.0
    for key in ("sync_after_load", "sync_after_steps"):
        rec = r[key]["receiver"]
        assert (
            rec["n_mismatched"] == 0
            and rec["n_missing"] == 0
            and rec["tensors"] == r[key]["tensors"] > 0
        )
