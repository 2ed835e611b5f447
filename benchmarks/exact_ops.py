"""Where the rollout's and the trainer's values part, op by op, at the thinker's real widths.

Each op of the text model (linears, grouped expert GEMM, attention, RMSNorm, router softmax, top-k
weighted sum, token log-softmax), torch's kernel (``rollout.exact_logprobs`` off) and
``omni_grpo.exact``'s (on): the share of a decode batch's rows bitwise equal to the same rows in
a training batch, and the time at both sizes (docs/benchmarks.md, "Methods").

    python benchmarks/exact_ops.py            # needs CUDA
"""

from collections.abc import Callable
from functools import partial
from typing import Any

import harness
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
    eager time is its launch (tens of microseconds of Python for Triton), not the kernel's."""
    from triton.testing import do_bench_cudagraph

    fn()  # compile / autotune outside the capture
    torch.cuda.synchronize()
    return float(do_bench_cudagraph(fn, rep=100, return_mode="median"))


def _equal_rows(part: torch.Tensor, full: torch.Tensor) -> float:
    return float((part == full).reshape(part.shape[0], -1).all(-1).float().mean())


def _by_expert(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, expert) pairs of ``ids`` [tokens, k] sorted by expert: their order (pair p =
    token * k + slot) and each expert's end offset."""
    e, perm = torch.sort(ids.reshape(-1), stable=True)
    return perm, torch.cumsum(torch.bincount(e, minlength=EXPERTS), 0).to(torch.int32)


def linears(dev: torch.device) -> dict[str, Any]:
    from omni_grpo.exact.matmul import linear

    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    shapes = {"q_proj": (HIDDEN, q), "kv_proj": (HIDDEN, kv), "o_proj": (q, HIDDEN)}
    shapes |= {"router": (HIDDEN, EXPERTS), "lora_a": (HIDDEN, 16), "lora_b": (16, q)}
    shapes["lm_head"] = (HIDDEN, VOCAB)
    out: dict[str, Any] = {}
    for name, (k, n) in shapes.items():
        a = torch.randn(TRAIN_ROWS, k, device=dev, dtype=torch.bfloat16)
        w = (torch.randn(n, k, device=dev) / k**0.5).to(torch.bfloat16)
        row: dict[str, Any] = {"k": k, "n": n}
        for label, fn in (("torch", F.linear), ("exact", linear)):
            full = fn(a, w)
            equal = {str(m): _equal_rows(fn(a[:m], w), full[:m]) for m in (1, 8, DECODE_ROWS, 512)}
            row[f"{label}_equal_rows"] = equal
            ms = _bench(partial(fn, a, w))
            row[f"{label}_train_ms"] = ms
            row[f"{label}_train_tflops"] = 2 * TRAIN_ROWS * k * n / ms / 1e9
            row[f"{label}_decode_ms"] = _bench_graph(partial(fn, a[:DECODE_ROWS], w))
        out[name] = row
    return out


def grouped(dev: torch.device) -> dict[str, Any]:
    from omni_grpo.exact.grouped import gmm
    from omni_grpo.models.grouped_experts import grouped_mm

    fn_torch = getattr(F, "grouped_mm", None) or torch._grouped_mm
    out: dict[str, Any] = {}
    for name, (k, n) in {"gate_up": (HIDDEN, 2 * EXPERT_FFN), "down": (EXPERT_FFN, HIDDEN)}.items():
        w = (torch.randn(EXPERTS, n, k, device=dev) / k**0.5).to(torch.bfloat16).transpose(1, 2)
        x = torch.randn(TRAIN_ROWS, k, device=dev, dtype=torch.bfloat16)
        ids = torch.rand(TRAIN_ROWS, EXPERTS, device=dev).topk(TOP_K, -1).indices
        row: dict[str, Any] = {"k": k, "n": n}
        (perm_t, offs_t), (perm_d, offs_d) = _by_expert(ids), _by_expert(ids[:DECODE_ROWS])
        xs_t, xs_d = x[perm_t // TOP_K], x[perm_d // TOP_K]
        # the decode pairs inside the training layout: pair p = token * k + slot
        pos_t = torch.empty_like(perm_t)
        pos_t[perm_t] = torch.arange(perm_t.numel(), device=dev)
        for label, fn in (("torch", lambda a, b, o: fn_torch(a, b, offs=o)), ("exact", gmm)):
            full, part = fn(xs_t, w, offs_t), fn(xs_d, w, offs_d)
            row[f"{label}_equal_rows"] = _equal_rows(part, full[pos_t[perm_d]])
            row[f"{label}_train_ms"] = _bench(partial(fn, xs_t, w, offs_t))
            flops = 2 * xs_t.shape[0] * k * n
            row[f"{label}_train_tflops"] = flops / row[f"{label}_train_ms"] / 1e9
            row[f"{label}_decode_ms"] = _bench_graph(partial(fn, xs_d, w, offs_d))
        out[name] = row
    # a decode step's expert LoRA term (x A^T) B^T of gate_up and down (rank 16), grouped, with
    # torch's grouped GEMM (off) and the exact one (on): GPU ms per layer
    rank, lora_decode = 16, {}
    perm, offs = _by_expert(torch.rand(DECODE_ROWS, EXPERTS, device=dev).topk(TOP_K, -1).indices)
    for name, (k, n) in {"gate_up": (HIDDEN, 2 * EXPERT_FFN), "down": (EXPERT_FFN, HIDDEN)}.items():
        x = torch.randn(perm.numel(), k, device=dev, dtype=torch.bfloat16)
        a_t = torch.randn(EXPERTS, k, rank, device=dev, dtype=torch.bfloat16)
        b_t = torch.randn(EXPERTS, rank, n, device=dev, dtype=torch.bfloat16)

        def lora(mm: Any, x: torch.Tensor = x, a: torch.Tensor = a_t, b: torch.Tensor = b_t) -> Any:
            return mm(mm(x, a, offs), b, offs)

        for label, mm in (("torch", grouped_mm), ("exact", gmm)):
            lora_decode[f"{label}_{name}_ms"] = _bench_graph(partial(lora, mm))
    out["lora_decode"] = lora_decode
    return out


def _compare(fns: Any, *rows: torch.Tensor, shared: tuple = (), bench: bool = True) -> dict:
    """Per (label, fn): the share of the first DECODE_ROWS rows computed alone that equal the
    same rows computed in the whole batch (``rows`` are cut, ``shared`` not), and the batch's time."""
    out: dict[str, Any] = {}
    for label, fn in fns:
        full, part = fn(*rows, *shared), fn(*(r[:DECODE_ROWS] for r in rows), *shared)
        out[f"{label}_equal_rows"] = _equal_rows(part, full[:DECODE_ROWS])
        if bench:
            out[f"{label}_train_ms"] = _bench(partial(fn, *rows, *shared))
    return out


def rowwise(dev: torch.device) -> dict[str, Any]:
    from omni_grpo.exact import rowwise as rw

    bf16 = {"device": dev, "dtype": torch.bfloat16}
    out: dict[str, Any] = {}
    rms = [("torch", rw._torch_rmsnorm), ("exact", rw.rmsnorm)]
    sizes = {"rmsnorm_hidden": (HIDDEN, TRAIN_ROWS), "rmsnorm_head": (HEAD_DIM, TRAIN_ROWS * HEADS)}
    for name, (width, rows) in sizes.items():
        x, w = torch.randn(rows, width, **bf16), torch.rand(width, **bf16)
        out[name] = _compare([(k, partial(f, eps=1e-6)) for k, f in rms], x, shared=(w,))
    z, tg = torch.randn(1024, VOCAB, device=dev) * 3, torch.randint(0, VOCAB, (1024,), device=dev)
    torch_lp = ("torch", lambda a, t: torch.log_softmax(a, -1).gather(-1, t[:, None])[:, 0])
    out["token_logprob"] = _compare((torch_lp, ("exact", rw.token_logprobs)), z, tg)
    r = torch.randn(TRAIN_ROWS, EXPERTS, device=dev).to(torch.bfloat16)
    softmax = (("torch", partial(torch.softmax, dim=-1, dtype=torch.float)), ("exact", rw.softmax))
    out["router_softmax"] = _compare(softmax, r, bench=False)
    pairs = torch.randn(TRAIN_ROWS, TOP_K, HIDDEN, **bf16)
    wts = torch.rand(TRAIN_ROWS, TOP_K, device=dev).to(torch.bfloat16)
    bmm_sum = ("torch_bmm", lambda p, w: torch.bmm(w.view(-1, 1, TOP_K), p).view(-1, HIDDEN))

    def slot_sum(p: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        acc = p[:, 0].float() * w[:, 0:1].float()
        for s in range(1, TOP_K):
            acc = acc + p[:, s].float() * w[:, s : s + 1].float()
        return acc.to(p.dtype)

    out["topk_weighted_sum"] = _compare((bmm_sum, ("exact", slot_sum)), pairs, wts)
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
    causal = keys[None, None] <= keys[None, :, None]
    full_mask = ((keys[None, None] >= starts[:, None, None]) & causal)[:, None]
    scale = HEAD_DIM**-0.5

    class _M(torch.nn.Module):
        num_key_value_groups = HEADS // KV_HEADS
        training = False

    kf, vf = k[:, :, :length], v[:, :, :length]

    def torch_full() -> torch.Tensor:
        kr, vr = (t.repeat_interleave(HEADS // KV_HEADS, 1) for t in (kf, vf))
        sdpa = F.scaled_dot_product_attention(q, kr, vr, attn_mask=full_mask, scale=scale)
        return sdpa.transpose(1, 2)

    def exact_full() -> torch.Tensor:
        return ex.attention_forward(_M(), q, kf, vf, full_mask, scaling=scale)[0]

    out: dict[str, Any] = {}
    positions = [400, 511, 512, 700, 1023]
    for label, full_fn in (("torch", torch_full), ("exact", exact_full)):
        full, equal = full_fn(), []
        for t in positions:
            dmask = torch.zeros(batch, 1, 1, length + extra, dtype=torch.bool, device=dev)
            dmask[:, 0, 0, : t + 1] = keys[: t + 1][None] >= starts[:, None]
            decode = gqa_decode_attention if label == "torch" else ex.attention_forward
            o = decode(_M(), q[:, :, t : t + 1], k, v, dmask, scaling=scale)[0]
            rows = batch * HEADS
            equal.append(_equal_rows(o[:, 0].reshape(rows, -1), full[:, t].reshape(rows, -1)))
        out[f"{label}_equal_rows"] = dict(zip(map(str, positions), equal, strict=True))
        out[f"{label}_full_ms"] = _bench(full_fn)
    dmask = torch.ones(batch * 8, 1, 1, length + extra, dtype=torch.bool, device=dev)
    qd = torch.randn(batch * 8, HEADS, 1, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    kd, vd = k.repeat(8, 1, 1, 1), v.repeat(8, 1, 1, 1)
    decode = partial(gqa_decode_attention, _M(), qd, kd, vd, dmask, scaling=scale)
    out["torch_decode_ms"] = _bench_graph(decode)
    # the off path's decode step: the split-KV kernel, each row from its first key to the slot
    kw = {START_KW: starts.repeat(8).to(torch.int32), SLOT_KW: torch.tensor([length], device=dev)}
    out["split_kv_decode_ms"] = _bench_graph(partial(decode, **kw))
    exact = partial(ex.attention_forward, _M(), qd, kd, vd, dmask, scaling=scale)
    out["exact_decode_ms"] = _bench_graph(exact)
    return out


if __name__ == "__main__":
    args = harness.parser(__doc__).parse_args()
    dev = harness.cuda_device("exact_ops.py")
    torch.manual_seed(0)
    result: dict[str, Any] = {"device": torch.cuda.get_device_name()}
    ops = {"linear": linears, "grouped": grouped, "rowwise": rowwise, "attention": attention}
    for name, fn in ops.items():
        try:
            result[name] = fn(dev)
        except Exception as err:  # report the others
            result[name] = {"error": f"{type(err).__name__}: {err}"}
        harness.progress({name: result[name]})
    harness.emit("exact_ops", result, args.save)
