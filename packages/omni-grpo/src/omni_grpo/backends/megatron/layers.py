"""Our megatron-core building blocks where the TE-less local spec falls short for Qwen3-Omni.

* :class:`RMSNorm` — HF-exact RMSNorm (fp32 statistics, weight applied in the input dtype) that,
  unlike megatron-core's ``WrappedTorchNorm``, works under sequence parallelism: its weight is
  tagged ``sequence_parallel`` so :func:`omni_grpo.backends.megatron.grads.finalize_grads` sums its
  gradient over the TP group (each rank saw only its sequence chunk).
* :class:`GroupedExperts` — all local experts of a layer in two stacked tensors, run with
  ``torch._grouped_mm`` (one kernel per GEMM instead of a Python loop over 128 experts; the local
  spec's ``SequentialMLP`` is the only TE-less alternative). Falls back to a per-expert loop where
  the grouped kernel cannot run (CPU, fp32, dims not 16-byte aligned) — same math.
* :class:`InterleavedMRope` — Qwen3's *interleaved* M-RoPE (``MultimodalRotaryEmbedding`` is the
  chunked Qwen2-VL layout); it takes explicit ``[3, B, S]`` position ids, never derives them.
* :func:`thinker_block_spec` — the local GPT layer spec with those three swapped in.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from omni_grpo.backends.megatron._mcore import mcore


def _param_device(config: Any) -> torch.device:
    if getattr(config, "use_cpu_initialization", False) or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


class RMSNorm(nn.Module):
    """``weight * (x / rms(x))`` with statistics in fp32, as transformers' Qwen3 RMSNorm."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-6, **_: Any) -> None:
        super().__init__()
        self.eps = float(eps)
        self.weight = nn.Parameter(
            torch.ones(hidden_size, dtype=config.params_dtype, device=_param_device(config))
        )
        # consumed by finalize_grads: under SP each TP rank holds a partial gradient
        self.weight.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def grouped_mm_supported(x: torch.Tensor, *dims: int) -> bool:
    """Whether ``torch._grouped_mm`` can run here: CUDA bf16 with 16-byte aligned strides."""
    return (
        x.is_cuda
        and x.dtype == torch.bfloat16
        and hasattr(torch, "_grouped_mm")
        and all((d * x.element_size()) % 16 == 0 for d in dims)
    )


class GroupedExperts(nn.Module):
    """Drop-in for megatron-core's experts module (same constructor and forward contract).

    Weights are stored in the HF hub / sglang layout, ``fc1_weight [E_local, H, 2I]`` (gate
    columns then up columns) and ``fc2_weight [E_local, I, H]``: that is exactly the ``[K, N]``
    operand ``torch._grouped_mm`` wants, and weight export / sync sends it without a transposing copy.
    forward(tokens sorted by local expert, tokens_per_expert, probs) -> (output, None).
    """

    def __init__(
        self,
        num_local_experts: int,
        config: Any,
        submodules: Any = None,
        pg_collection: Any = None,
        name: str | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.num_local_experts = num_local_experts
        hidden, inter = config.hidden_size, config.moe_ffn_hidden_size
        dev, dtype = _param_device(config), config.params_dtype
        self.fc1_weight = nn.Parameter(
            torch.empty(num_local_experts, hidden, 2 * inter, device=dev, dtype=dtype)
        )
        self.fc2_weight = nn.Parameter(
            torch.empty(num_local_experts, inter, hidden, device=dev, dtype=dtype)
        )
        std = getattr(config, "init_method_std", 0.02)
        with torch.no_grad():
            self.fc1_weight.normal_(0.0, std)
            self.fc2_weight.normal_(0.0, std)
        for p in (self.fc1_weight, self.fc2_weight):
            p.allreduce = False  # megatron's marker for expert-parallel params
            p.expert_parallel = True
        self.use_grouped_mm = True  # benchmarks flip this to time the loop

    def _loop(self, x: torch.Tensor, counts: list[int], probs: torch.Tensor) -> torch.Tensor:
        outs = []
        for e, (xe, pe) in enumerate(
            zip(torch.split(x, counts), torch.split(probs, counts), strict=False)
        ):
            h = xe @ self.fc1_weight[e]
            gate, up = h.chunk(2, dim=-1)
            a = (F.silu(gate) * up * pe.unsqueeze(-1)).to(x.dtype)
            outs.append(a @ self.fc2_weight[e])
        return torch.cat(outs, dim=0) if outs else x.new_zeros(0, self.fc2_weight.shape[2])

    def forward(
        self,
        permuted_hidden: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        permuted_probs: torch.Tensor,
    ) -> tuple[torch.Tensor, None]:
        inter, hidden = self.fc2_weight.shape[1], self.fc2_weight.shape[2]
        if self.use_grouped_mm and grouped_mm_supported(permuted_hidden, hidden, inter):
            offs = torch.cumsum(tokens_per_expert.to(permuted_hidden.device), 0).to(torch.int32)
            h = torch._grouped_mm(permuted_hidden, self.fc1_weight, offs=offs)
            gate, up = h.chunk(2, dim=-1)
            a = (F.silu(gate) * up * permuted_probs.unsqueeze(-1)).to(permuted_hidden.dtype)
            out = torch._grouped_mm(a, self.fc2_weight, offs=offs)
            return out, None
        counts = [int(c) for c in tokens_per_expert.tolist()]
        return self._loop(permuted_hidden, counts, permuted_probs), None


class InterleavedMRope(nn.Module):
    """Qwen3 M-RoPE from explicit ``[3, B, S]`` positions -> megatron's ``[S, B, 1, head_dim]`` freqs.

    Interleaved layout (Qwen3): channel ``i`` of the half-dim uses h when ``i % 3 == 1`` and
    ``i < 3*section[1]``, w when ``i % 3 == 2`` and ``i < 3*section[2]``, else t. Chunked layout
    (Qwen2-VL) when ``interleaved`` is false. Output is rotate-half layout (``cat(f, f)``).
    """

    def __init__(
        self, head_dim: int, base: float, section: tuple[int, ...], interleaved: bool
    ) -> None:
        super().__init__()
        if sum(section) != head_dim // 2:
            raise ValueError(f"mrope_section {section} must sum to head_dim/2 = {head_dim // 2}")
        self.section = tuple(int(s) for s in section)
        self.interleaved = interleaved
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        self.register_buffer("inv_freq", 1.0 / (float(base) ** exponent), persistent=False)

    def forward(
        self, position_ids: torch.Tensor, mrope_section: Any = None, cp_group: Any = None
    ) -> torch.Tensor:
        if position_ids.ndim != 3 or position_ids.shape[0] != 3:
            raise ValueError(
                f"position_ids must be [3, B, S] (t/h/w), got {tuple(position_ids.shape)}"
            )
        inv = self.inv_freq.to(position_ids.device)
        freqs = position_ids.float()[..., None] * inv  # [3, B, S, D/2]
        if self.interleaved:
            f = freqs[0].clone()
            for dim in (1, 2):
                idx = slice(dim, 3 * self.section[dim], 3)
                f[..., idx] = freqs[dim][..., idx]
        else:
            parts = freqs.split(list(self.section), dim=-1)
            f = torch.cat([p[i % 3] for i, p in enumerate(parts)], dim=-1)
        emb = torch.cat([f, f], dim=-1)  # [B, S, D]
        return emb.transpose(0, 1).unsqueeze(2).contiguous()


class SdpaAttention(nn.Module):
    """Causal core attention through ``F.scaled_dot_product_attention`` (flash / efficient kernels).

    Replaces the local spec's ``DotProductAttention``, which materialises the ``[B*heads, S, S]``
    scores in fp32 (TE's fused attention is the other alternative and needs TE). Same contract:
    query ``[s, b, heads, d]``, key/value ``[s, b, groups, d]`` -> context ``[s, b, heads*d]``.
    Batches are right-padded, so the causal mask alone is exact for every real token.
    """

    def __init__(
        self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str, **kw: Any
    ) -> None:
        super().__init__()
        self.config = config
        self.softmax_scale = kw.get("softmax_scale")

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any = None,
        attn_mask_type: Any = None,
        attention_bias: Any = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError(
                "SdpaAttention supports padded causal batches only (no THD packing, no bias)"
            )
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d]
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=k.shape[1] != q.shape[1]
        )
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


def thinker_block_spec(num_layers: int, num_experts: int, experts_impl: str) -> Any:
    """Transformer-block submodules: local spec + our RMSNorm, experts and (in model.py) rotary."""
    m = mcore()
    layer = m.get_gpt_layer_local_spec(
        num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=True, normalization="RMSNorm"
    )
    sub = layer.submodules
    attn = sub.self_attention
    attn = dataclasses.replace(
        attn,
        submodules=dataclasses.replace(
            attn.submodules, q_layernorm=RMSNorm, k_layernorm=RMSNorm, core_attention=SdpaAttention
        ),
    )
    mlp = sub.mlp
    if experts_impl == "grouped":
        moe_sub = dataclasses.replace(mlp.keywords["submodules"], experts=GroupedExperts)
        mlp = functools.partial(mlp.func, *mlp.args, **{**mlp.keywords, "submodules": moe_sub})
    elif experts_impl != "sequential":
        raise ValueError(f"experts_impl must be 'grouped' or 'sequential', got {experts_impl!r}")
    sub = dataclasses.replace(
        sub, input_layernorm=RMSNorm, pre_mlp_layernorm=RMSNorm, self_attention=attn, mlp=mlp
    )
    layer = dataclasses.replace(layer, submodules=sub)
    return m.TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=RMSNorm)
