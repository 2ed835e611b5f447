"""Can this parallel layout start with this thinker? Checked by ``--plan`` and before a run starts.

The placement plan (``omni_grpo.ray.placement``) knows GPU counts; whether a TP size can shard
the model is a question of the model's shapes and of each engine's sharding rules. Asked too late,
it is a failed start on a 16-GPU allocation (an assertion deep in a server's model constructor);
asked here it is a one-line refusal naming the field and a value that works.

The rules, as read from the source of the versions we pin:

**sglang-omni 0.1.9** (PyPI wheel; it pins sglang 0.5.22):

* The Qwen3-Omni pipelines run the audio and image encoders as stages of their own, each
  transformers' tower unsharded on one GPU: ``sglang_omni/models/qwen3_omni/stages.py``
  (``create_audio_encoder_executor``, ``create_image_encoder_executor``) build
  ``components/audio_encoder.py:Qwen3OmniAudioEncoder`` (``hf_modeling.Qwen3OmniMoeAudioEncoder``
  on ``device``) and ``components/image_encoder.py``; the thinker stage keeps "only the text model
  and LM head" (``components/sglang_thinker.py``). So the audio tower's 20 heads and the vision
  tower's 16 never meet the TP size: the vLLM failure (vllm#50858, vllm-omni#4322: audio encoder
  sharded by TP, 20 % 8 != 0) has no counterpart here.
* Thinker attention (sglang ``srt/models/qwen3_moe.py:Qwen3MoeAttention``, through
  ``srt/models/qwen3_vl_moe.py:Qwen3MoeLLMModel``): ``num_attention_heads % tp == 0``; KV heads
  are partitioned when ``kv >= tp`` (``kv % tp == 0``) and replicated otherwise (``tp % kv == 0``):
  the 4 KV heads at TP 8 are each held by 2 ranks.
* Experts (``srt/layers/moe/fused_moe_triton/layer.py:FusedMoE``): ``moe_intermediate_size % tp
  == 0``; ``qwen3_moe.py:Qwen3MoeSparseMoeBlock`` refuses ``tp > num_experts``.
* A TP stage needs ``tp`` GPU ids and a process of its own (``sglang_omni/config/schema.py``); the
  text-only pipeline puts every stage in process ``pipeline`` on GPU 0, so the launcher passes
  ``--thinker.tp_size N --thinker.gpu [0..N-1] --thinker.process thinker``
  (:func:`omni_grpo.serve.thinker_tp_args`).

**Megatron** (megatron-core 0.19.2 and our loader, ``backends/megatron/config_map.py``):

* megatron-core's ``TransformerConfig``: ``num_attention_heads % tp == 0``, ``num_query_groups``
  a multiple or divisor of ``tp``; our loader splits the fused QKV per KV group and does not
  replicate groups, so ``num_key_value_heads % tp == 0``; the vocab-parallel LM head needs
  ``vocab_size % tp == 0``; experts: ``num_experts % ep == 0`` (expert TP 1,
  ``parallel_state.initialize_model_parallel(..., expert_tensor_parallel_size=1)``).
* The vision and audio towers are transformers modules replicated on every rank
  (``backends/megatron/model.py:load_visual``, omni-audio-inject): their heads are not split.

Shapes come from the model's own ``config.json`` (extracted ``vl``, the hub checkpoint, or the run
directory's prepared model); when none is readable on the planning machine and the config names an
Omni checkpoint, from the released Qwen3-Omni-30B-A3B's config, and the plan says so.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omni_grpo.ray.placement import PlacementError, PlacementPlan


class LayoutError(PlacementError):
    """The layout fits the GPUs but cannot shard this model; the message names the field."""


@dataclass(frozen=True)
class ThinkerShapes:
    """The shapes that decide which TP sizes can shard the thinker."""

    num_attention_heads: int
    num_key_value_heads: int
    moe_intermediate_size: int
    num_experts: int
    vocab_size: int
    vision_heads: int | None
    audio_heads: int | None
    source: str


#: Qwen3-Omni-30B-A3B-Instruct's thinker (hub config.json; shared/reference qwen3_omni_layout §3.1).
RELEASED_30B_A3B = ThinkerShapes(
    num_attention_heads=32,
    num_key_value_heads=4,
    moe_intermediate_size=768,
    num_experts=128,
    vocab_size=152064,
    vision_heads=16,
    audio_heads=20,
    source="the released Qwen3-Omni-30B-A3B config (no model config.json readable here)",
)


_TEXT_KEYS = (
    "num_attention_heads",
    "num_key_value_heads",
    "moe_intermediate_size",
    "num_experts",
    "vocab_size",
)


def shapes_from_config(config: dict[str, Any], source: str) -> ThinkerShapes:
    """Shapes from a hub Omni ``config.json`` (``thinker_config``) or an extracted ``vl`` one."""
    thinker = config.get("thinker_config", config)
    text = thinker.get("text_config", thinker)
    vision = thinker.get("vision_config") or {}
    audio = thinker.get("audio_config") or {}
    missing = [k for k in _TEXT_KEYS if k not in text]
    if missing:
        raise LayoutError(f"{source}: text_config has no {', '.join(missing)}")
    return ThinkerShapes(
        num_attention_heads=int(text["num_attention_heads"]),
        num_key_value_heads=int(text["num_key_value_heads"]),
        moe_intermediate_size=int(text["moe_intermediate_size"]),
        num_experts=int(text["num_experts"]),
        vocab_size=int(text["vocab_size"]),
        vision_heads=int(vision["num_heads"]) if "num_heads" in vision else None,
        audio_heads=(
            int(audio["encoder_attention_heads"]) if "encoder_attention_heads" in audio else None
        ),
        source=source,
    )


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def find_shapes(cfg: Any) -> ThinkerShapes | None:
    """The thinker's shapes from the first readable config; ``None`` when they are not known yet
    (a ``make_tiny`` model that has not been made)."""
    model = cfg.model
    run_dir = Path(cfg.run.dir)
    candidates = [
        Path(model.extracted_dir) / "config.json" if model.extracted_dir else None,
        Path(model.omni_checkpoint) / "config.json" if model.omni_checkpoint else None,
        run_dir / "model" / "vl" / "config.json",
    ]
    for path in candidates:
        if path is None:
            continue
        config = _read(path)
        if config is not None:
            shapes = shapes_from_config(config, str(path))
            if shapes.audio_heads is None and model.audio_dir:
                audio = _read(Path(model.audio_dir) / "config.json") or {}
                if "encoder_attention_heads" in audio:
                    heads = int(audio["encoder_attention_heads"])
                    shapes = ThinkerShapes(**{**shapes.__dict__, "audio_heads": heads})
            return shapes
    return RELEASED_30B_A3B if model.omni_checkpoint else None


# ------------------------------------------------------------------------------------ the rules
def sglang_tp_problems(s: ThinkerShapes, tp: int) -> list[str]:
    """Why sglang-omni 0.1.9 cannot run the thinker at TP ``tp`` ([] when it can)."""
    out = []
    if s.num_attention_heads % tp:
        out.append(f"num_attention_heads {s.num_attention_heads} is not divisible by {tp}")
    kv = s.num_key_value_heads
    if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
        out.append(
            f"{kv} KV heads can be neither split over {tp} ranks nor replicated on them "
            f"(needs {kv} % tp == 0 or tp % {kv} == 0)"
        )
    if s.moe_intermediate_size % tp:
        out.append(f"moe_intermediate_size {s.moe_intermediate_size} is not divisible by {tp}")
    if tp > s.num_experts:
        out.append(f"TP {tp} exceeds num_experts {s.num_experts}")
    return out


def megatron_tp_problems(s: ThinkerShapes, tp: int) -> list[str]:
    """Why the Megatron backend cannot shard the thinker at tensor parallel ``tp``."""
    out = []
    for name, value in (
        ("num_attention_heads", s.num_attention_heads),
        ("num_key_value_heads", s.num_key_value_heads),
        ("vocab_size", s.vocab_size),
    ):
        if value % tp:
            out.append(f"{name} {value} is not divisible by {tp}")
    return out


def megatron_ep_problems(s: ThinkerShapes, ep: int) -> list[str]:
    return [f"num_experts {s.num_experts} is not divisible by {ep}"] if s.num_experts % ep else []


def _fitting(problems: Any, s: ThinkerShapes, limit: int) -> list[int]:
    return [n for n in range(1, limit + 1) if not problems(s, n)]


def _listed(values: list[int]) -> str:
    return ", ".join(map(str, values)) if values else "none up to the node size"


def _towers(s: ThinkerShapes) -> str:
    parts = []
    if s.vision_heads is not None:
        parts.append(f"vision {s.vision_heads}")
    if s.audio_heads is not None:
        parts.append(f"audio {s.audio_heads}")
    return f"towers ({' and '.join(parts)} heads)" if parts else "towers"


# --------------------------------------------------------------------------------- the check
def check_layout(cfg: Any, plan: PlacementPlan) -> list[str]:
    """Refuse a layout that cannot shard the thinker (:class:`LayoutError`); else the plan's notes.

    Checked: the Megatron trainer's ``tp`` / ``ep`` and every launched sglang-omni server's
    thinker TP (= ``gpus_per_server``, or ``--thinker.tp_size`` in its ``extra_args``). External
    servers (``rollout.sglang.urls``) were started by someone else with a TP we cannot see.
    """
    from omni_grpo.serve import launched_thinker_tp

    megatron = cfg.trainer.backend == "megatron"
    launch = cfg.rollout.sglang.launch if cfg.rollout.engine == "sglang-omni" else None
    server = launch is not None and launch.kind == "sglang-omni"
    if not (megatron or server):
        return []
    shapes = find_shapes(cfg)
    if shapes is None:
        return ["layout: the model's shapes are not known before make_tiny runs; not checked"]
    limit = max(int(cfg.ray.gpus_per_node), 1)
    notes = [f"layout checked against {shapes.source}:"]
    if megatron:
        tp, ep = plan.tp, plan.ep
        bad = megatron_tp_problems(shapes, tp)
        if bad:
            fit = _fitting(megatron_tp_problems, shapes, limit)
            raise LayoutError(
                f"trainer.megatron.tp={tp} cannot shard this thinker ({'; '.join(bad)}; "
                f"shapes from {shapes.source}); tp that fit: {_listed(fit)}"
                + (f" (e.g. --set trainer.megatron.tp={max(fit)})" if fit else "")
            )
        bad = megatron_ep_problems(shapes, ep)
        if bad:
            fit = [
                n
                for n in range(1, plan.world_size + 1)
                if plan.world_size % n == 0 and not megatron_ep_problems(shapes, n)
            ]
            raise LayoutError(
                f"trainer.megatron.ep={ep} cannot shard this thinker's experts ({bad[0]}); "
                f"ep that fit trainer.world_size {plan.world_size}: {_listed(fit)}"
            )
        notes.append(
            f"  megatron tp {tp}: {shapes.num_attention_heads // tp} attention heads and "
            f"{shapes.num_key_value_heads // tp} KV heads per rank; ep {ep}: "
            f"{shapes.num_experts // ep} experts per rank; {_towers(shapes)} replicated, not split"
        )
    if server:
        assert launch is not None
        tp = launched_thinker_tp(launch)
        bad = sglang_tp_problems(shapes, tp)
        if bad:
            fit = _fitting(sglang_tp_problems, shapes, limit)
            raise LayoutError(
                f"rollout.sglang.launch.gpus_per_server={launch.gpus_per_server} runs the "
                f"sglang-omni 0.1.9 thinker at TP {tp}, which cannot shard it "
                f"({'; '.join(bad)}; shapes from {shapes.source}); GPUs per server that fit: "
                f"{_listed(fit)}"
                + (f" (e.g. --set rollout.sglang.launch.gpus_per_server={max(fit)})" if fit else "")
            )
        kv = shapes.num_key_value_heads
        kv_note = (
            f"{kv // tp} KV heads per rank"
            if kv >= tp
            else f"each of {kv} KV heads on {tp // kv} ranks"
        )
        notes.append(
            f"  sglang-omni thinker TP {tp}: {shapes.num_attention_heads // tp} attention heads, "
            f"{kv_note}; {_towers(shapes)} unsharded on the server's first GPU"
        )
    return notes
