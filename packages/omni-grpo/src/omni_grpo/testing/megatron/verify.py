"""GPU verification of the Megatron thinker (run on the device machine; pytest wraps it as ``gpu``).

``python -m omni_grpo.testing.megatron.verify parity OUT.json``
    Megatron forward logits vs transformers' ``Qwen3OmniMoeThinkerForConditionalGeneration`` on a
    factory checkpoint with audio + image + video + text (fp32, then bf16), positions from omni-rope.
``torchrun --nproc-per-node 2 -m omni_grpo.testing.megatron.verify tp OUT.json``
    TP=2 / EP=2 / SP: logits parity against HF, two GRPO steps with the shared loss, and two
    weight-sync round trips (after load: against the checkpoint file; after the steps: against the
    trainer's own export written to disk) into a receiver process checking every tensor bit-exactly.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def make_checkpoint(root: Path) -> dict[str, Path]:
    from omni_extract import extract
    from omni_extract.tiny import TinyOmniSpec, make_tiny_omni

    paths = {"omni": root / "omni", "vl": root / "vl", "audio": root / "audio"}
    if not (paths["vl"] / "config.json").exists():
        make_tiny_omni(paths["omni"], TinyOmniSpec())
        extract(paths["omni"], paths["vl"], variant="vl")
        extract(paths["omni"], paths["audio"], variant="audio")
    return paths


def mm_batch(
    cfg: dict[str, Any], seed: int = 0, rows: int = 2
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """Two rows of text + image (1x4x4) + video (2x4x4) + audio (300 mel frames); positions from omni-rope."""
    from omni_rope import OmniRopeConfig, positions_from_mm

    from omni_grpo.models.sideband import parse_sideband

    side = parse_sideband(cfg)
    vs, ve, img, vid, as_, ae, aud = (
        side.id(k)
        for k in (
            "vision_start_token_id",
            "vision_end_token_id",
            "image_token_id",
            "video_token_id",
            "audio_start_token_id",
            "audio_end_token_id",
            "audio_token_id",
        )
    )
    row = [5, 6, vs, *[img] * 4, ve, vs, *[vid] * 8, ve, as_, *[aud] * 39, ae, 7]
    ids = torch.tensor([row] * rows)
    g = torch.Generator().manual_seed(seed)
    mm = {
        "pixel_values": torch.randn(16 * rows, 1536, generator=g),
        "image_grid_thw": torch.tensor([[1, 4, 4]] * rows),
        "pixel_values_videos": torch.randn(32 * rows, 1536, generator=g),
        "video_grid_thw": torch.tensor([[2, 4, 4]] * rows),
        "video_second_per_grid": torch.tensor([1.0] * rows),
        "input_features": torch.randn(rows, 128, 300, generator=g),
        "feature_attention_mask": torch.ones(rows, 300, dtype=torch.long),
    }
    pos, _ = positions_from_mm(ids, None, mm, OmniRopeConfig.from_vl_config(cfg))
    return ids, mm, pos


def hf_logits(
    omni: Path,
    ids: torch.Tensor,
    mm: dict[str, torch.Tensor],
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    from transformers import Qwen3OmniMoeThinkerForConditionalGeneration

    try:  # the eager expert loop is the plain reference (grouped_mm has no fp32 CUDA kernel)
        hf = Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(
            str(omni), dtype=dtype, experts_implementation="eager"
        )
    except (TypeError, ValueError):
        hf = Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(str(omni), dtype=dtype)
    hf = hf.to(device).eval()
    with torch.no_grad():
        out = hf(
            input_ids=ids.to(device),
            attention_mask=torch.ones_like(ids).to(device),
            **{k: v.to(device) for k, v in mm.items()},
        ).logits
    return out.float()


def _diff(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    a, b = a.float(), b.float()
    return {
        "max_abs": float((a - b).abs().max()),
        "rel_l2": float((a - b).norm() / b.norm()),
        "ref_max_abs": float(b.abs().max()),
        "argmax_agree": float((a.argmax(-1) == b.argmax(-1)).float().mean()),
    }


def parity(out: Path) -> dict[str, Any]:
    from omni_grpo.backends.megatron.model import build_thinker, init_parallel, read_vl_config
    from omni_grpo.config import MegatronConfig

    init_parallel(MegatronConfig())
    dev = torch.device("cuda", torch.cuda.current_device())
    paths = make_checkpoint(Path(os.environ.get("OMNI_VERIFY_DIR") or tempfile.mkdtemp()))
    cfg = read_vl_config(paths["vl"])
    ids, mm, pos = mm_batch(cfg)
    report: dict[str, Any] = {"tokens": list(ids.shape)}
    ref32 = hf_logits(paths["omni"], ids, mm, torch.float32, dev)
    for precision, _dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        for impl in ("grouped", "sequential"):
            th = build_thinker(
                paths["vl"],
                MegatronConfig(precision=precision),
                audio_dir=paths["audio"],
                experts_impl=impl,
            )
            th.eval()
            with torch.no_grad():
                logits = th(ids.to(dev), pos.to(dev), {k: v.to(dev) for k, v in mm.items()}).float()
            report[f"{precision}_{impl}_vs_hf_fp32"] = _diff(logits, ref32)
            if precision == "bf16":
                ref16 = hf_logits(paths["omni"], ids, mm, torch.bfloat16, dev)
                report[f"bf16_{impl}_vs_hf_bf16"] = _diff(logits, ref16)
                report["hf_bf16_vs_hf_fp32"] = _diff(ref16, ref32)
            del th
    # text only rows (sequential positions)
    th = build_thinker(paths["vl"], MegatronConfig(precision="fp32"), audio_dir=paths["audio"])
    tids = torch.randint(0, 300, (2, 32))
    tpos = torch.arange(32, dtype=torch.float32)[None, None].expand(3, 2, 32)
    with torch.no_grad():
        report["fp32_text_only_vs_hf_fp32"] = _diff(
            th(tids.to(dev), tpos.to(dev)).float(),
            hf_logits(paths["omni"], tids, {}, torch.float32, dev),
        )
    out.write_text(json.dumps(report, indent=1))
    return report


def _grpo_batch(cfg: dict[str, Any], n_prompts: int, group: int, seed: int) -> Any:
    """The loop's ``GRPOBatch``: ``n_prompts`` media prompts, ``group`` random completions each."""
    from omni_grpo.algo import group_advantages
    from omni_grpo.types import Completion, GRPOBatch, PromptInputs, Sample

    g = torch.Generator().manual_seed(seed)
    ids, mm, _pos = mm_batch(cfg, seed, rows=1)
    prompt = PromptInputs(Sample("verify", "", ""), ids[0].tolist(), mm)
    groups = []
    for _ in range(n_prompts):
        rows = []
        for _ in range(group):
            n_resp = int(torch.randint(3, 9, (1,), generator=g))
            resp = torch.randint(0, 300, (n_resp,), generator=g).tolist()
            rows.append(Completion(prompt, resp, [0.0] * n_resp, "stop"))
        groups.append(rows)
    rewards = torch.rand(n_prompts, group, generator=g)
    return GRPOBatch(groups, group_advantages(rewards, group))


def tp_step(out: Path) -> dict[str, Any]:
    from safetensors.torch import save_file

    from omni_grpo.backends.megatron import mcore
    from omni_grpo.backends.megatron.backend import MegatronBackend
    from omni_grpo.backends.megatron.model import (
        SafetensorsDir,
        build_thinker,
        init_parallel,
        read_vl_config,
    )
    from omni_grpo.config import AlgoConfig, MegatronConfig, TrainerConfig
    from omni_grpo.sync.base import ServerTensors
    from omni_grpo.sync.group import build_group, host_store
    from omni_grpo.testing.megatron.sender import push_to_receiver, start_receiver

    mcfg = MegatronConfig(tp=2, ep=2, sp=True, precision="fp32", max_tokens_per_gpu=256)
    init_parallel(mcfg)
    rank = dist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device())
    root = Path(os.environ.get("OMNI_VERIFY_DIR", "/tmp/omni_verify"))
    if rank == 0:
        make_checkpoint(root)
    dist.barrier()
    paths = make_checkpoint(root)
    cfg = read_vl_config(paths["vl"])
    report: dict[str, Any] = {
        "layout": {"tp": 2, "ep": 2, "sp": True, "world": dist.get_world_size()}
    }

    th = build_thinker(paths["vl"], mcfg, audio_dir=paths["audio"])
    ids, mm, pos = mm_batch(cfg)  # S = 60: a multiple of tp
    th.eval()
    with torch.no_grad():
        local = th(ids.to(dev), pos.to(dev), {k: v.to(dev) for k, v in mm.items()})
        full = mcore().gather_from_tensor_model_parallel_region(local).float()
    if rank == 0:
        report["tp2_ep2_sp_logits_vs_hf_fp32"] = _diff(
            full, hf_logits(paths["omni"], ids, mm, torch.float32, dev)
        )

    # ---- weight sync round trip 0: the freshly loaded model must equal the checkpoint file bit for bit
    store = group = proc = None
    exp0 = root / "expected_0.safetensors"
    exp1 = root / "expected_1.safetensors"
    if rank == 0:
        src = SafetensorsDir(paths["vl"])
        vl_lm = [
            (k, src.get(k)) for k in src if k.startswith(("model.language_model.", "lm_head."))
        ]
        save_file(dict(ServerTensors(vl_lm, "vl_hub")), str(exp0))
        store = host_store("127.0.0.1", 2, 600)
        proc = start_receiver(
            store.port, "cuda:1", str(root / "expected_{round}.safetensors"), 2, "omni_grpo_verify"
        )
        group = build_group(
            store,
            group_name="omni_grpo_verify",
            world_size=2,
            rank=0,
            backend="nccl",
            timeout_s=600,
        )
    exported = list(th_export(th))
    if rank == 0:
        report["sync_after_load"] = push_to_receiver(group, store, exported, 0, 1 << 20, dev)
    dist.barrier()

    # ---- two GRPO steps through the backend's own step (the shared loss and step policy)
    backend = MegatronBackend(
        th, cfg, TrainerConfig(backend="megatron", lr=1e-3, megatron=mcfg), AlgoConfig()
    )
    before = {n: p.detach().clone() for n, p in th.lm.named_parameters()}
    steps = []
    for s in range(2):
        steps.append(backend.step(_grpo_batch(cfg, n_prompts=2, group=2, seed=10 + s)))
    changed = sum(int(not torch.equal(before[n], p)) for n, p in th.lm.named_parameters())
    report["grpo_steps"] = steps
    report["params_changed"] = f"{changed}/{len(before)}"
    # replicated (non-TP-sharded, non-expert) params must stay identical across ranks
    drift = 0.0
    for _n, p in th.lm.named_parameters():
        if getattr(p, "tensor_model_parallel", False) or getattr(p, "allreduce", True) is False:
            continue
        other = p.detach().clone()
        dist.broadcast(other, src=0)
        drift = max(drift, float((other - p.detach()).abs().max()))
    report["replicated_param_max_drift_across_ranks"] = drift

    # ---- round trip 1: after the steps, against the trainer's own export written to disk
    exported = list(th_export(th))
    if rank == 0:
        save_file(dict(ServerTensors([(k, v.cpu()) for k, v in exported], "vl_hub")), str(exp1))
        report["sync_after_steps"] = push_to_receiver(group, store, exported, 1, 1 << 20, dev)
        report["receiver_exit"] = proc.wait(timeout=300)
        out.write_text(json.dumps(report, indent=1))
    dist.barrier()
    return report


def th_export(th: Any) -> Any:
    from omni_grpo.backends.megatron.export import export_hf_weights

    return export_hf_weights(th.lm, th.args)


def main(argv: list[str] | None = None) -> int:
    argv = argv if argv is not None else sys.argv[1:]
    what, out = argv[0], Path(argv[1])
    report = {"parity": parity, "tp": tp_step}[what](out)
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(json.dumps(report, indent=1))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
