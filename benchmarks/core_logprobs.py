"""Token logprobs from bf16 logits: omni_grpo.algo's chunked+checkpointed path vs the naive
``log_softmax(logits.float()).gather`` baseline, same inputs, same run.

Prints one JSON object: bytes autograd keeps for backward (deduplicated by storage), forward+backward
wall time, and the max |difference| of values and gradients. Usage: uv run python benchmarks/core_logprobs.py
"""

from __future__ import annotations

import json
import time

import torch
from omni_grpo.algo import token_logprobs_from_logits

ROWS, VOCAB = 1024, 152064  # Qwen3-Omni's vocabulary


def naive(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), -1).gather(-1, targets[:, None]).squeeze(-1)


def measure(fn, logits: torch.Tensor, targets: torch.Tensor) -> dict:  # type: ignore[no-untyped-def]
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
        return t

    x = logits.detach().requires_grad_()
    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(x, targets)
    out.sum().backward()
    wall = time.perf_counter() - t0
    return {
        "saved_bytes": sum(seen.values()),
        "wall_s": wall,
        "out": out.detach(),
        "grad": x.grad.float(),
    }


def main() -> None:
    torch.manual_seed(0)
    logits = (torch.randn(ROWS, VOCAB) * 3).to(torch.bfloat16)
    targets = torch.randint(0, VOCAB, (ROWS,))

    def chunked(lg: torch.Tensor, tg: torch.Tensor) -> torch.Tensor:
        return token_logprobs_from_logits(lg, tg, chunk_rows=128)

    for fn in (naive, chunked):  # warm-up (first checkpoint call has a one-time cost)
        measure(fn, logits[:256], targets[:256])
    base = measure(naive, logits, targets)
    ours = measure(chunked, logits, targets)
    print(
        json.dumps(
            {
                "rows": ROWS,
                "vocab": VOCAB,
                "logits_bytes_bf16": logits.numel() * 2,
                "baseline": "naive log_softmax(logits.float()).gather",
                "baseline_saved_bytes": base["saved_bytes"],
                "chunked_saved_bytes": ours["saved_bytes"],
                "saved_bytes_ratio": ours["saved_bytes"] / base["saved_bytes"],
                "baseline_wall_s": round(base["wall_s"], 3),
                "chunked_wall_s": round(ours["wall_s"], 3),
                "wall_ratio": round(ours["wall_s"] / base["wall_s"], 3),
                "max_abs_diff_logp": float((ours["out"] - base["out"]).abs().max()),
                "max_abs_diff_grad": float((ours["grad"] - base["grad"]).abs().max()),
                "torch_threads": torch.get_num_threads(),
            }
        )
    )


if __name__ == "__main__":
    main()
