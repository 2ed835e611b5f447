"""Where the rollout's and the trainer's values part, op by op, at the thinker's real widths.

For each op of the text model (the linear layers, the grouped expert GEMM, attention, RMSNorm,
the router softmax, the top-k weighted sum, the token log-softmax) this computes the same rows
once inside a training-sized batch and once inside a decode-sized one, and reports the share
of rows that come out bitwise equal — for torch's kernel (what runs with
``rollout.exact_logprobs`` off) and for ``omni_grpo.exact``'s (on) — and the time of each at
the training size (median of ``triton.testing.do_bench``) and at the decode size (replayed from a
CUDA graph as the decode step is: ``do_bench_cudagraph``, so a small op's time is its kernel's,
not its launch's). Attention's decode time is given for SDPA, for the off path's split-KV kernel
and for the exact kernel; the experts' LoRA term for both grouped GEMMs.

Attention compares a decode step (one query against a left-padded static KV buffer, the decode
path's packed-GQA SDPA; ours: the exact kernel) with the full-sequence forward (transformers'
SDPA with a boolean mask; ours: the same exact kernel) for the same query and keys.

Prints ONE JSON object.

    python benchmarks/exact_ops.py            # needs CUDA
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 2048, 32, 4, 128
EXPERTS, TOP_K, EXPERT_FFN, VOCAB = 128, 8, 768, 152064
TRAIN_ROWS, DECODE_ROWS = 4096, 64


def _bench(fn: Callable[[], Any]) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def _bench_graph(fn: Callable[[], Any]) -> float:
    """GPU time of ``fn`` replayed from a CUDA graph, as the decode step runs it: a small op's
    eager time is its launch (a Triton launch costs tens of microseconds of Python), not the
    kernel's."""
    from triton.testing import do_bench_cudagraph

    fn()  # compile / autotune outside the capture
    torch.cuda.synchronize()
    return float(do_bench_cudagraph(fn, rep=100, return_mode="median"))


def _equal_rows(part: torch.Tensor, full: torch.Tensor) -> float:
    return float((part == full).reshape(part.shape[0], -1).all(-1).float().mean())


def linears(dev: torch.device) -> dict[str, Any]:
    from omni_grpo.exact.matmul import linear

    shapes = {
        "q_proj": (HIDDEN, HEADS * HEAD_DIM),
        "kv_proj": (HIDDEN, KV_HEADS * HEAD_DIM),
        "o_proj": (HEADS * HEAD_DIM, HIDDEN),
        "router": (HIDDEN, EXPERTS),
        "lora_a": (HIDDEN, 16),
        "lora_b": (16, HEADS * HEAD_DIM),
        "lm_head": (HIDDEN, VOCAB),
    }
    out: dict[str, Any] = {}
    for name, (k, n) in shapes.items():
        a = torch.randn(TRAIN_ROWS, k, device=dev, dtype=torch.bfloat16)
        w = (torch.randn(n, k, device=dev) / k**0.5).to(torch.bfloat16)
        row: dict[str, Any] = {"k": k, "n": n}
        for label, fn in (("torch", F.linear), ("exact", linear)):
            full = fn(a, w)
            row[f"{label}_equal_rows"] = {
                str(m): _equal_rows(fn(a[:m], w), full[:m]) for m in (1, 8, DECODE_ROWS, 512)
            }
            ms = _bench(partial(fn, a, w))
            row[f"{label}_train_ms"] = ms
            row[f"{label}_train_tflops"] = 2 * TRAIN_ROWS * k * n / ms / 1e9
            row[f"{label}_decode_ms"] = _bench_graph(partial(fn, a[:DECODE_ROWS], w))
        out[name] = row
    return out


def grouped(dev: torch.device) -> dict[str, Any]:
    from omni_grpo.exact.grouped import gmm

    fn_torch = getattr(F, "grouped_mm", None) or torch._grouped_mm
    out: dict[str, Any] = {}
    for name, (k, n) in {"gate_up": (HIDDEN, 2 * EXPERT_FFN), "down": (EXPERT_FFN, HIDDEN)}.items():
        w = (torch.randn(EXPERTS, n, k, device=dev) / k**0.5).to(torch.bfloat16).transpose(1, 2)
        x = torch.randn(TRAIN_ROWS, k, device=dev, dtype=torch.bfloat16)
        ids = torch.rand(TRAIN_ROWS, EXPERTS, device=dev).topk(TOP_K, -1).indices

        def layout(
            tokens: int, ids: torch.Tensor = ids, x: torch.Tensor = x
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            flat = ids[:tokens].reshape(-1)
            e, perm = torch.sort(flat, stable=True)
            counts = torch.bincount(e, minlength=EXPERTS)
            return x[perm // TOP_K], torch.cumsum(counts, 0).to(torch.int32), perm

        row: dict[str, Any] = {"k": k, "n": n}
        xs_t, offs_t, perm_t = layout(TRAIN_ROWS)
        xs_d, offs_d, perm_d = layout(DECODE_ROWS)
        # the decode pairs inside the training layout: pair p = token * k + slot
        pos_t = torch.empty_like(perm_t)
        pos_t[perm_t] = torch.arange(perm_t.numel(), device=dev)
        for label, fn in (("torch", lambda a, b, o: fn_torch(a, b, offs=o)), ("exact", gmm)):
            full = fn(xs_t, w, offs_t)
            part = fn(xs_d, w, offs_d)
            row[f"{label}_equal_rows"] = _equal_rows(part, full[pos_t[perm_d]])
            row[f"{label}_train_ms"] = _bench(partial(fn, xs_t, w, offs_t))
            row[f"{label}_train_tflops"] = (
                2 * xs_t.shape[0] * k * n / row[f"{label}_train_ms"] / 1e9
            )
            row[f"{label}_decode_ms"] = _bench_graph(partial(fn, xs_d, w, offs_d))
        out[name] = row
    out["lora_decode"] = _grouped_lora_decode(dev)
    return out


def _grouped_lora_decode(dev: torch.device) -> dict[str, Any]:
    """A decode step's expert LoRA term ``(x A^T) B^T`` of gate_up and down (rank 16), grouped,
    with torch's grouped GEMM (off) and the exact one (on): GPU ms per layer."""
    from omni_grpo.exact.grouped import gmm
    from omni_grpo.models.grouped_experts import grouped_mm

    rank = 16
    ids = torch.rand(DECODE_ROWS, EXPERTS, device=dev).topk(TOP_K, -1).indices.reshape(-1)
    e, perm = torch.sort(ids, stable=True)
    offs = torch.cumsum(torch.bincount(e, minlength=EXPERTS), 0).to(torch.int32)
    out: dict[str, Any] = {}
    for name, (k, n) in {"gate_up": (HIDDEN, 2 * EXPERT_FFN), "down": (EXPERT_FFN, HIDDEN)}.items():
        x = torch.randn(perm.numel(), k, device=dev, dtype=torch.bfloat16)
        a_t = torch.randn(EXPERTS, k, rank, device=dev, dtype=torch.bfloat16)
        b_t = torch.randn(EXPERTS, rank, n, device=dev, dtype=torch.bfloat16)
        out[f"torch_{name}_ms"] = _bench_graph(
            lambda x=x, a=a_t, b=b_t: grouped_mm(grouped_mm(x, a, offs), b, offs)
        )
        out[f"exact_{name}_ms"] = _bench_graph(
            lambda x=x, a=a_t, b=b_t: gmm(gmm(x, a, offs), b, offs)
        )
    return out


def rowwise(dev: torch.device) -> dict[str, Any]:
    from omni_grpo.exact import rowwise as rw

    out: dict[str, Any] = {}

    def hf_rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return rw._torch_rmsnorm(x, w, 1e-6)

    for name, width, rows in (
        ("rmsnorm_hidden", HIDDEN, TRAIN_ROWS),
        ("rmsnorm_head", HEAD_DIM, TRAIN_ROWS * HEADS),
    ):
        x = torch.randn(rows, width, device=dev, dtype=torch.bfloat16)
        w = torch.rand(width, device=dev, dtype=torch.bfloat16)
        row: dict[str, Any] = {}
        for label, fn in (("torch", hf_rms), ("exact", lambda a, b: rw.rmsnorm(a, b, 1e-6))):
            full = fn(x, w)
            row[f"{label}_equal_rows"] = _equal_rows(fn(x[:DECODE_ROWS], w), full[:DECODE_ROWS])
            row[f"{label}_train_ms"] = _bench(partial(fn, x, w))
        out[name] = row
    z = torch.randn(1024, VOCAB, device=dev) * 3
    tg = torch.randint(0, VOCAB, (1024,), device=dev)

    def torch_lp(a: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(a, -1).gather(-1, t[:, None])[:, 0]

    row = {}
    for label, fn in (("torch", torch_lp), ("exact", rw.token_logprobs)):
        full = fn(z, tg)
        row[f"{label}_equal_rows"] = _equal_rows(
            fn(z[:DECODE_ROWS], tg[:DECODE_ROWS]), full[:DECODE_ROWS]
        )
        row[f"{label}_train_ms"] = _bench(partial(fn, z, tg))
    out["token_logprob"] = row
    r = torch.randn(TRAIN_ROWS, EXPERTS, device=dev).to(torch.bfloat16)
    row = {}
    for label, fn in (
        ("torch", lambda a: torch.softmax(a, -1, dtype=torch.float)),
        ("exact", rw.softmax),
    ):
        row[f"{label}_equal_rows"] = _equal_rows(fn(r[:DECODE_ROWS]), fn(r)[:DECODE_ROWS])
    out["router_softmax"] = row
    pairs = torch.randn(TRAIN_ROWS, TOP_K, HIDDEN, device=dev, dtype=torch.bfloat16)
    wts = torch.rand(TRAIN_ROWS, TOP_K, device=dev).to(torch.bfloat16)

    def bmm_sum(p: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.bmm(w.view(-1, 1, TOP_K), p).view(-1, HIDDEN)

    def slot_sum(p: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        acc = p[:, 0].float() * w[:, 0:1].float()
        for s in range(1, TOP_K):
            acc = acc + p[:, s].float() * w[:, s : s + 1].float()
        return acc.to(p.dtype)

    row = {}
    for label, fn in (("torch_bmm", bmm_sum), ("exact", slot_sum)):
        full = fn(pairs, wts)
        row[f"{label}_equal_rows"] = _equal_rows(
            fn(pairs[:DECODE_ROWS], wts[:DECODE_ROWS]), full[:DECODE_ROWS]
        )
        row[f"{label}_train_ms"] = _bench(partial(fn, pairs, wts))
    out["topk_weighted_sum"] = row
    return out


def attention(dev: torch.device) -> dict[str, Any]:
    from omni_grpo.exact import attention as ex
    from omni_grpo.models.decode_attention import SLOT_KW, START_KW, gqa_decode_attention

    batch, length, extra = 8, 1024, 64
    g = torch.Generator(device="cpu").manual_seed(0)
    starts = torch.randint(0, 300, (batch,), generator=g).to(dev)
    q = torch.randn(batch, HEADS, length, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    k = torch.randn(batch, KV_HEADS, length + extra, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    keys = torch.arange(length, device=dev)
    full_mask = (keys[None, None] >= starts[:, None, None]) & (
        keys[None, None] <= keys[None, :, None]
    )
    full_mask = full_mask[:, None]
    scale = HEAD_DIM**-0.5

    class _M(torch.nn.Module):
        num_key_value_groups = HEADS // KV_HEADS
        training = False

    rep = HEADS // KV_HEADS
    kf, vf = k[:, :, :length], v[:, :, :length]

    def torch_full() -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q,
            kf.repeat_interleave(rep, 1),
            vf.repeat_interleave(rep, 1),
            attn_mask=full_mask,
            scale=scale,
        ).transpose(1, 2)

    def exact_full() -> torch.Tensor:
        return ex.attention_forward(_M(), q, kf, vf, full_mask, scaling=scale)[0]

    out: dict[str, Any] = {}
    positions = [400, 511, 512, 700, 1023]
    for label, full_fn in (("torch", torch_full), ("exact", exact_full)):
        full = full_fn()
        equal = []
        for t in positions:
            dmask = torch.zeros(batch, 1, 1, length + extra, dtype=torch.bool, device=dev)
            dmask[:, 0, 0, : t + 1] = keys[: t + 1][None] >= starts[:, None]
            qt = q[:, :, t : t + 1]
            if label == "torch":
                o = gqa_decode_attention(_M(), qt, k, v, dmask, scaling=scale)[0]
            else:
                o = ex.attention_forward(_M(), qt, k, v, dmask, scaling=scale)[0]
            equal.append(
                _equal_rows(
                    o[:, 0].reshape(batch * HEADS, -1), full[:, t].reshape(batch * HEADS, -1)
                )
            )
        out[f"{label}_equal_rows"] = dict(zip(map(str, positions), equal, strict=True))
        out[f"{label}_full_ms"] = _bench(full_fn)
    dmask = torch.ones(batch * 8, 1, 1, length + extra, dtype=torch.bool, device=dev)
    qd = torch.randn(batch * 8, HEADS, 1, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    kd = k.repeat(8, 1, 1, 1)
    vd = v.repeat(8, 1, 1, 1)
    out["torch_decode_ms"] = _bench_graph(
        lambda: gqa_decode_attention(_M(), qd, kd, vd, dmask, scaling=scale)
    )
    # the off path's decode step: the split-KV kernel, each row from its first key to the slot
    kw = {START_KW: starts.repeat(8).to(torch.int32), SLOT_KW: torch.tensor([length], device=dev)}
    out["split_kv_decode_ms"] = _bench_graph(
        lambda: gqa_decode_attention(_M(), qd, kd, vd, dmask, scaling=scale, **kw)
    )
    out["exact_decode_ms"] = _bench_graph(
        lambda: ex.attention_forward(_M(), qd, kd, vd, dmask, scaling=scale)
    )
    return out


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("exact_ops.py needs a CUDA device")
    dev = torch.device("cuda")
    torch.manual_seed(0)
    result: dict[str, Any] = {"benchmark": "exact_ops", "device": torch.cuda.get_device_name()}
    for name, fn in (
        ("linear", linears),
        ("grouped", grouped),
        ("rowwise", rowwise),
        ("attention", attention),
    ):
        try:
            result[name] = fn(dev)
        except Exception as err:  # report the others
            result[name] = {"error": f"{type(err).__name__}: {err}"}
        print(json.dumps({name: result[name]}), file=sys.stderr, flush=True)
    result["versions"] = {"torch": torch.__version__}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
