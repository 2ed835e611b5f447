"""rollout.exact_logprobs' torch-kernel switch on CPU (``omni_grpo.exact.switch``): gradient
checkpointing's recompute and the KL reference forward compute with torch's kernels, the first
forward (the one that gives the policy logprobs) with the exact ones.

The Triton launchers are replaced by counting torch stand-ins (no GPU, no interpreter needed):
what is checked is which path each Function takes, that torch's non-reentrant checkpoint accepts
the recompute (its saved tensors' metadata), that the attention backward takes the recompute's
SDPA graph, and that the gradients are torch's.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.utils.checkpoint import checkpoint

B, L, H, KVH, D, HIDDEN, E, TOP_K = 2, 12, 4, 2, 16, 32, 4, 2


def _sdpa_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *_: Any) -> torch.Tensor:
    scale = _[-1]
    g = q.shape[1] // k.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), is_causal=True, scale=scale
    )
    return out.transpose(1, 2).contiguous()


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Every exact launcher replaced by a torch stand-in that counts its calls and fails if it
    runs under ``torch_kernels`` (where torch's kernels must be used instead)."""
    from omni_grpo.exact import attention, combine, grouped, matmul, precision, rowwise, switch

    monkeypatch.setattr(precision, "COMPUTE_DTYPE", torch.float32)
    calls: Counter[str] = Counter()

    def counted(name: str, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def launch(*args: Any, **kwargs: Any) -> torch.Tensor:
            assert not switch.torch_kernels_on(), f"{name}: an exact kernel under torch_kernels"
            calls[name] += 1
            return fn(*args, **kwargs)

        return launch

    def mm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, *_: Any) -> Any:
        return a @ b if bias is None else a @ b + bias

    def topk(rows: torch.Tensor, inv: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> Any:
        return (rows[inv].view(*w.shape, -1) * w[..., None]).sum(1).to(dtype)

    monkeypatch.setattr(matmul, "mm", counted("mm", mm))

    def gmm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, *rest: Any) -> torch.Tensor:
        out = grouped._reference_gmm(x, w, offs)  # plan and row tiling: the same products
        residual = rest[2] if len(rest) > 2 else None
        return out if residual is None else residual + out

    monkeypatch.setattr(grouped, "gmm", counted("gmm", gmm))
    monkeypatch.setattr(rowwise, "rmsnorm_rows", counted("rmsnorm", rowwise._torch_rmsnorm))
    monkeypatch.setattr(attention, "exact_attention", counted("attention", _sdpa_reference))
    monkeypatch.setattr(combine, "topk_sum_rows_kernel", counted("topk_sum", topk))
    return calls


def _weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    shapes = {
        "norm": (HIDDEN,),
        "q": (H * D, HIDDEN),
        "k": (KVH * D, HIDDEN),
        "v": (KVH * D, HIDDEN),
        "o": (HIDDEN, H * D),
        "gate": (E, HIDDEN),
        "experts": (E, HIDDEN, HIDDEN),
    }
    return {n: (torch.randn(s) / 4).requires_grad_() for n, s in shapes.items()}


def _layer(x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
    """A decoder layer made of every exact Function: RMSNorm, the q/k/v/o products, attention,
    the router, the grouped experts and the top-k sum."""
    from omni_grpo.exact.attention import attention_forward
    from omni_grpo.exact.combine import unsort_topk_sum
    from omni_grpo.exact.grouped import grouped_linear
    from omni_grpo.exact.matmul import linear
    from omni_grpo.exact.moe import route
    from omni_grpo.exact.rowwise import rmsnorm
    from omni_grpo.models.grouped_experts import ExpandSorted, sort_by_expert

    f32 = torch.float32
    h = rmsnorm(x, w["norm"], 1e-6)
    q = linear(h, w["q"], None, f32).view(B, L, H, D).transpose(1, 2)
    k = linear(h, w["k"], None, f32).view(B, L, KVH, D).transpose(1, 2)
    v = linear(h, w["v"], None, f32).view(B, L, KVH, D).transpose(1, 2)
    a, _ = attention_forward(None, q, k, v, None, scaling=D**-0.5)  # type: ignore[arg-type]
    h = x + linear(a.reshape(B, L, H * D), w["o"], None, f32)
    flat = h.reshape(-1, HIDDEN)
    index, weights = route(SimpleNamespace(weight=w["gate"]), flat, TOP_K)
    perm, inv, offs = sort_by_expert(index, E, stable=True)
    xs = ExpandSorted.apply(flat, perm // TOP_K, inv, TOP_K)
    rows = grouped_linear(xs, w["experts"], offs)
    return h + unsort_topk_sum(rows, inv, perm, weights, f32).view_as(h)


def _grads(out: torch.Tensor, x: torch.Tensor, w: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    g = torch.linspace(-1, 1, out.numel()).view_as(out)
    return list(torch.autograd.grad(out, [x, *w.values()], g))


def test_recompute_runs_torch_kernels_and_the_first_forward_the_exact_ones(
    launches: Counter[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from omni_grpo.exact import attention, switch

    w = _weights()
    x = torch.randn(B, L, HIDDEN, requires_grad=True)
    exact = _layer(x, w)  # the exact path alone (no checkpoint)
    assert launches == {"mm": 5, "gmm": 1, "rmsnorm": 1, "attention": 1, "topk_sum": 1}
    launches.clear()
    with switch.torch_kernels():  # torch's kernels throughout: the gradients to match
        want = _grads(_layer(x, w), x, w)
    assert not launches

    def no_sdpa_recompute(*_: Any) -> torch.Tensor:
        raise AssertionError("the attention backward re-ran SDPA's forward")

    monkeypatch.setattr(attention, "allowed_mask", no_sdpa_recompute)
    out = checkpoint(_layer, x, w, use_reentrant=False, context_fn=switch.recompute_context)
    assert torch.equal(out, exact)  # the first forward is the exact one, bit for bit
    got = _grads(out, x, w)  # the recompute (under torch_kernels) would fail a stand-in
    assert launches == {"mm": 5, "gmm": 1, "rmsnorm": 1, "attention": 1, "topk_sum": 1}
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)


def test_the_thinker_checkpoints_with_the_recompute_context() -> None:
    """``OmniThinker.gradient_checkpointing_enable`` hands ``recompute_context`` to torch's
    checkpoint (non-reentrant only: the reentrant variant takes no context)."""
    from omni_grpo.exact.switch import recompute_context
    from omni_grpo.models.thinker import OmniThinker

    seen: list[dict[str, Any]] = []
    fake = SimpleNamespace(
        _vl=SimpleNamespace(activation_checkpointing_enable=lambda **kw: seen.append(kw))
    )
    OmniThinker.gradient_checkpointing_enable(fake)  # type: ignore[arg-type]
    OmniThinker.gradient_checkpointing_enable(fake, use_reentrant=True)  # type: ignore[arg-type]
    kwargs = [s["activation_checkpointing_kwargs"] for s in seen]
    assert kwargs == [
        {"use_reentrant": False, "context_fn": recompute_context},
        {"use_reentrant": True},
    ]


def test_torch_kernels_nests_and_is_per_thread() -> None:
    import threading

    from omni_grpo.exact.switch import torch_kernels, torch_kernels_on

    seen: list[bool] = []
    with torch_kernels():
        with torch_kernels():
            assert torch_kernels_on()
        assert torch_kernels_on()
        thread = threading.Thread(target=lambda: seen.append(torch_kernels_on()))
        thread.start()
        thread.join()
    assert not torch_kernels_on() and seen == [False]
