"""The text model's bytes and FLOPs: what a roofline of the thinker's generation and update counts.

A decode step is bound by what it must read once (bf16 weights of the dense parts, the distinct
experts its rows route to, LoRA factors, every row's KV); a prefill or a training pass by its
matmuls. Sizes come from the checkpoint's config so that the same model serves every depth and
width; ``harness.device_limits`` gives the rates they are divided by.
"""

from typing import Any


def text_sizes(cfg: dict[str, Any], lora_rank: int, targets: list[str]) -> dict[str, float]:
    """Parameter counts of the text model, per kind (what a token reads and computes)."""
    t = cfg["text_config"]
    keys = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim")
    h, heads, kvh, hd = (t[k] for k in keys)
    e, k, ffn = t["num_experts"], t["num_experts_per_tok"], t["moe_intermediate_size"]
    vocab, layers = t["vocab_size"], t["num_hidden_layers"]
    attn = h * heads * hd * 2 + h * kvh * hd * 2
    expert, r = 3 * ffn * h, lora_rank
    attn_lora = r * (2 * h + heads * hd) * 2 + r * (h + kvh * hd) * 2
    expert_lora = r * (h + 2 * ffn) + r * (ffn + h)  # per expert
    out = {"layers": layers, "hidden": h, "experts": e, "top_k": k}
    out["kv_bytes_per_token_layer"] = 2 * kvh * hd * 2
    out["dense_per_layer"] = attn + e * h + 2 * h + 2 * hd  # attention, router, norms
    out |= {"expert_params": expert, "lm_head": vocab * h}
    out["attn_lora_per_layer"] = attn_lora if "attention" in targets else 0
    out["expert_lora_params"] = expert_lora if "experts" in targets else 0
    out["active_per_token"] = layers * (attn + e * h + k * expert) + vocab * h
    return out | {"attn_per_layer": attn, "heads": heads, "head_dim": hd}


def decode_step_bytes(s: dict[str, float], rows: int, kv_len_sum: int) -> float:
    """Bytes one decode step over ``rows`` rows must read (bf16 weights, LoRA factors in bf16):
    the expected distinct experts hit are ``E * (1 - (1 - k/E)^rows)``."""
    hit = s["experts"] * (1 - (1 - s["top_k"] / s["experts"]) ** rows)
    experts = hit * (s["expert_params"] + s["expert_lora_params"])
    per_layer = s["dense_per_layer"] + s["attn_lora_per_layer"] + experts
    weights = 2 * (s["layers"] * per_layer + s["lm_head"])
    return weights + kv_len_sum * s["layers"] * s["kv_bytes_per_token_layer"]


def variable_decode_bytes(s: dict[str, float], prompt_lens: list[int], lengths: list[int]) -> float:
    """Bytes the decode steps must read when every row runs at once and leaves when it ends:
    step t (tokens 2.. of a row come from decode steps) reads the weights the rows still running
    route to and their KV (prompt + t keys each)."""
    total = 0.0
    order = sorted(zip(lengths, prompt_lens, strict=True))
    for t in range(1, max(lengths)):
        live = [p for n, p in order if n > t]
        total += decode_step_bytes(s, len(live), sum(p + t for p in live))
    return total


def attention_flops(s: dict[str, float], seq_lens: list[int]) -> float:
    """Causal attention scores and their weighted sum over each sequence."""
    return sum(2 * 2 * s["layers"] * s["heads"] * s["head_dim"] * n * (n + 1) / 2 for n in seq_lens)


def forward_flops(s: dict[str, float], seq_lens: list[int], logits_tokens: int) -> float:
    """Forward FLOPs of the text model over sequences (matmuls + causal attention scores)."""
    per_token, attention = 2 * (s["active_per_token"] - s["lm_head"]), attention_flops(s, seq_lens)
    return per_token * sum(seq_lens) + attention + 2 * s["lm_head"] * logits_tokens


def recompute_flops(s: dict, seq_lens: list[int], logits_tokens: int, policy: str) -> float:
    """FLOPs the backward's recompute runs: the decoder layers' forward (the LM head is outside
    them); ``selective`` keeps the attention's products (projections and core) instead."""
    flops = forward_flops(s, seq_lens, logits_tokens) - 2 * s["lm_head"] * logits_tokens
    if policy == "selective":
        flops -= 2 * s["layers"] * s["attn_per_layer"] * sum(seq_lens)
        flops -= attention_flops(s, seq_lens)
    return flops
