"""Token logprobs from bf16 logits: omni_grpo.algo's chunked+checkpointed path vs the naive
``log_softmax(logits.float()).gather``: bytes autograd keeps (by storage), wall time, differences.

    uv run python benchmarks/core_logprobs.py
"""

from functools import partial
from typing import Any

import harness
import torch
from omni_grpo.algo import token_logprobs_from_logits

ROWS, VOCAB = 1024, 152064  # Qwen3-Omni's vocabulary


def measure(fn: Any, logits: torch.Tensor, targets: torch.Tensor) -> dict[str, Any]:
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
        return t

    x = logits.detach().requires_grad_()
    with harness.timed() as t, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(x, targets)
        out.sum().backward()
    return {"saved": sum(seen.values()), "s": t.s, "out": out.detach(), "grad": x.grad.float()}


if __name__ == "__main__":
    args = harness.parser(__doc__).parse_args()
    torch.manual_seed(0)
    logits = (torch.randn(ROWS, VOCAB) * 3).to(torch.bfloat16)
    targets = torch.randint(0, VOCAB, (ROWS,))

    def naive(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(logits.float(), -1).gather(-1, targets[:, None]).squeeze(-1)

    chunked = partial(token_logprobs_from_logits, chunk_rows=128)
    for fn in (naive, chunked):  # warm-up (the first checkpoint call has a one-time cost)
        measure(fn, logits[:256], targets[:256])
    base, ours = measure(naive, logits, targets), measure(chunked, logits, targets)
    record = {"rows": ROWS, "vocab": VOCAB, "logits_bytes_bf16": logits.numel() * 2}
    record |= {"baseline": "naive log_softmax(logits.float()).gather"}
    record |= {"baseline_saved_bytes": base["saved"], "chunked_saved_bytes": ours["saved"]}
    record |= {"saved_bytes_ratio": ours["saved"] / base["saved"]}
    record |= {"baseline_wall_s": round(base["s"], 3), "chunked_wall_s": round(ours["s"], 3)}
    record |= {"wall_ratio": round(ours["s"] / base["s"], 3)}
    record["max_abs_diff_logp"] = float((ours["out"] - base["out"]).abs().max())
    record["max_abs_diff_grad"] = float((ours["grad"] - base["grad"]).abs().max())
    record["torch_threads"] = torch.get_num_threads()
    harness.emit("core_logprobs", record, args.save)
