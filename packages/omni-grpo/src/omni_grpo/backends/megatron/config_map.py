"""Translate the extracted pseudo-VL ``config.json`` + ``TrainerConfig.megatron`` into megatron-core args.

Pure data in, pure data out (no megatron import): CPU CI checks every field, and the GPU code turns
the result into a ``TransformerConfig`` with :func:`omni_grpo.backends.megatron.model.build_transformer_config`.

Why each non-obvious value is what it is:

* Qwen3 routers take softmax over all experts, keep the top-k and (``norm_topk_prob``) renormalise.
  megatron-core with ``moe_router_pre_softmax=False`` takes top-k of the logits and softmaxes over
  those k — the same numbers. Without renormalisation it must softmax first (``pre_softmax=True``).
* Qwen3 M-RoPE is *interleaved* (channel i takes t/h/w by i mod 3), which megatron-core's
  ``MultimodalRotaryEmbedding`` cannot express (it is Qwen2-VL's chunked layout); the model swaps in
  our own rotary module, so ``mrope_interleaved`` travels here as data.
* megatron-core refuses MoE + TP without sequence parallelism: we raise a clear error rather than
  silently flipping the user's ``sp``.
* Without transformer-engine the only expert path is ``SequentialMLP`` (a Python loop over experts);
  ``grouped_experts`` selects our ``torch._grouped_mm`` module instead (same math, one kernel per GEMM).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from omni_grpo.models.sideband import parse_sideband

ExpertsImpl = Literal["grouped", "sequential"]


class MegatronConfigError(ValueError):
    """The model config and the parallel layout do not fit together; the message names the field."""


@dataclass(frozen=True)
class MegatronModelArgs:
    """Everything needed to build the thinker's language model with megatron-core."""

    transformer: dict[str, Any]  # kwargs of megatron.core TransformerConfig (activation as a name)
    vocab_size: int
    max_sequence_length: int
    rotary_base: float
    mrope_section: tuple[int, ...]
    mrope_interleaved: bool
    share_embeddings_and_output_weights: bool
    experts_impl: ExpertsImpl
    # ids the model needs at run time (read from config, never hard-coded)
    token_ids: dict[str, int] = field(default_factory=dict)
    deepstack_layers: int = 0

    @property
    def num_experts(self) -> int:
        return int(self.transformer["num_moe_experts"])

    @property
    def head_dim(self) -> int:
        return int(self.transformer["kv_channels"])


_REQUIRED_TEXT_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "moe_intermediate_size",
    "num_experts",
    "num_experts_per_tok",
    "vocab_size",
)

_RECOMPUTE: dict[str, dict[str, Any]] = {
    "none": {"recompute_granularity": None},
    "selective": {"recompute_granularity": "selective"},
    "full": {
        "recompute_granularity": "full",
        "recompute_method": "uniform",
        "recompute_num_layers": 1,
    },
}

_TOKEN_KEYS = (
    "image_token_id",
    "video_token_id",
    "vision_start_token_id",
    "vision_end_token_id",
)


def _rope(text: dict[str, Any], source: str) -> tuple[float, list[int], bool]:
    """Theta, section and interleaving from ``rope_parameters`` (transformers 5) or legacy keys."""
    params = dict(text.get("rope_scaling") or {})
    params.update(text.get("rope_parameters") or {})
    theta = params.get("rope_theta", text.get("rope_theta"))
    section = params.get("mrope_section")
    if theta is None:
        raise MegatronConfigError(
            f"{source}: text_config has no rope_theta (rope_parameters.rope_theta)"
        )
    if not section:
        raise MegatronConfigError(
            f"{source}: text_config has no mrope_section (rope_parameters.mrope_section)"
        )
    interleaved = bool(params.get("mrope_interleaved", params.get("interleaved", False)))
    return float(theta), [int(s) for s in section], interleaved


def megatron_model_args(
    config: dict[str, Any],
    megatron: Any,
    *,
    world_size: int | None = None,
    experts_impl: ExpertsImpl = "grouped",
    source: str = "config.json",
) -> MegatronModelArgs:
    """Build :class:`MegatronModelArgs` from the extracted ``vl/config.json`` dict and a ``MegatronConfig``.

    ``config`` may be the full pseudo-VL config (with ``text_config``) or a bare text config.
    ``world_size`` (when known) is checked against ``tp * pp`` and ``ep``.
    """
    text = dict(config.get("text_config", config))
    missing = [k for k in _REQUIRED_TEXT_KEYS if k not in text]
    if missing:
        raise MegatronConfigError(f"{source}: text_config lacks {missing}")
    tp, ep, pp = int(megatron.tp), int(megatron.ep), int(megatron.pp)
    hidden = int(text["hidden_size"])
    heads = int(text["num_attention_heads"])
    groups = int(text["num_key_value_heads"])
    head_dim = int(text.get("head_dim") or hidden // heads)
    experts = int(text["num_experts"])
    vocab = int(text["vocab_size"])
    layers = int(text["num_hidden_layers"])

    dense = [int(i) for i in text.get("mlp_only_layers") or []]
    step = int(text.get("decoder_sparse_step", 1) or 1)
    if dense or step != 1:
        raise MegatronConfigError(
            f"{source}: mlp_only_layers={dense}, decoder_sparse_step={step}: the Megatron path builds an "
            "all-MoE decoder (as in Qwen3-Omni); dense layers are not mapped"
        )
    if experts <= 0:
        raise MegatronConfigError(f"{source}: num_experts must be > 0 (got {experts})")
    act = text.get("hidden_act", "silu")
    if act != "silu":
        raise MegatronConfigError(
            f"{source}: hidden_act {act!r} unsupported (expected 'silu' / SwiGLU)"
        )

    theta, section, interleaved = _rope(text, source)
    if sum(section) != head_dim // 2:
        raise MegatronConfigError(
            f"{source}: mrope_section {section} sums to {sum(section)}, expected head_dim/2 = {head_dim // 2}"
        )
    if tp > 1 and not megatron.sp:
        raise MegatronConfigError(
            f"trainer.megatron.sp is false with tp={tp}: megatron-core requires sequence parallelism for "
            "MoE with tensor parallelism; set trainer.megatron.sp: true"
        )
    for name, value, divisor in (
        ("num_attention_heads", heads, tp),
        ("num_key_value_heads", groups, tp),
        ("vocab_size", vocab, tp),
        ("num_experts", experts, ep),
    ):
        if value % divisor:
            raise MegatronConfigError(
                f"{source}: {name}={value} is not divisible by "
                f"{'ep' if name == 'num_experts' else 'tp'}={divisor}"
            )
    if heads % groups:
        raise MegatronConfigError(
            f"{source}: num_attention_heads={heads} not divisible by num_key_value_heads={groups}"
        )
    if world_size is not None:
        if world_size % (tp * pp):
            raise MegatronConfigError(
                f"world size {world_size} is not divisible by tp*pp = {tp * pp}"
            )
        if world_size % ep:
            raise MegatronConfigError(f"world size {world_size} is not divisible by ep = {ep}")

    bf16 = megatron.precision == "bf16"
    tie = bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    transformer: dict[str, Any] = {
        "num_layers": layers,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_query_groups": groups,
        "kv_channels": head_dim,
        "ffn_hidden_size": int(text.get("intermediate_size") or text["moe_intermediate_size"]),
        "moe_ffn_hidden_size": int(text["moe_intermediate_size"]),
        "num_moe_experts": experts,
        "moe_router_topk": int(text["num_experts_per_tok"]),
        "moe_router_pre_softmax": not bool(text.get("norm_topk_prob", True)),
        "moe_router_score_function": "softmax",
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_router_dtype": "fp32",
        "moe_token_dispatcher_type": "allgather",
        "moe_grouped_gemm": False,  # the TE flag; our grouped module is chosen by experts_impl
        "moe_permute_fusion": False,
        "normalization": "RMSNorm",
        "layernorm_epsilon": float(text.get("rms_norm_eps", 1e-6)),
        "qk_layernorm": True,
        "gated_linear_unit": True,
        "activation_func": "silu",
        "add_bias_linear": False,
        "add_qkv_bias": bool(text.get("attention_bias", False)),
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "attention_softmax_in_fp32": True,
        "bias_activation_fusion": False,
        "bias_dropout_fusion": False,
        "masked_softmax_fusion": False,
        "persist_layer_norm": False,
        "apply_rope_fusion": False,
        "gradient_accumulation_fusion": False,
        "cross_entropy_loss_fusion": False,
        "mrope_section": list(section),
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": pp,
        "expert_model_parallel_size": ep,
        "expert_tensor_parallel_size": 1,
        "sequence_parallel": bool(megatron.sp and tp > 1),
        "bf16": bf16,
        "params_dtype": "bfloat16" if bf16 else "float32",
        "pipeline_dtype": "bfloat16" if bf16 else "float32",
        **_RECOMPUTE[megatron.recompute],
    }
    token_ids = {k: int(config[k]) for k in _TOKEN_KEYS if k in config}
    if "omni_sideband" in config:  # a bare text config has none (and no audio)
        side = parse_sideband(config, source)
        token_ids["audio_token_id"] = side.audio_token_id
        token_ids["audio_start_token_id"] = side.id("audio_start_token_id")
        token_ids["position_id_per_seconds"] = side.raw["position_id_per_seconds"]
    deepstack = len((config.get("vision_config") or {}).get("deepstack_visual_indexes") or [])
    return MegatronModelArgs(
        transformer=transformer,
        vocab_size=vocab,
        max_sequence_length=int(text.get("max_position_embeddings", 65536)),
        rotary_base=theta,
        mrope_section=tuple(section),
        mrope_interleaved=interleaved,
        share_embeddings_and_output_weights=tie,
        experts_impl=experts_impl,
        token_ids=token_ids,
        deepstack_layers=deepstack,
    )
