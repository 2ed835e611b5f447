"""The continuous decoder's keyed sampling noise per decode step: torch's int64 hash against the
one-kernel Triton version (``omni_grpo.models.noise_kernel``), with torch's Philox exponential
draw (what the static decoder uses) as the baseline. GPU milliseconds per ``[rows, 151,936]``
block (the released vocabulary), mean of 50 calls after 3 warm-up calls; the limit is writing
the block once at the measured copy rate (outside the decoder's CUDA graphs a call also pays its
launch, so the kernel's figure is an upper bound).
"""

from __future__ import annotations

import statistics

import harness
import torch
from omni_grpo.models.continuous import keyed_noise_torch, row_keys
from omni_grpo.models.noise_kernel import keyed_noise

VOCAB = 151936


def main() -> None:
    args = harness.parser(__doc__, rows=[64, 256]).parse_args()
    limits = harness.device_limits("cuda")
    out: dict[str, float] = {"copy_bytes_per_s": limits["copy_bytes_per_s"]}
    for b in args.rows:
        rows = torch.arange(b, device="cuda")
        key = row_keys(3, rows, rows)
        sides = {
            "torch": lambda key=key: keyed_noise_torch(key, VOCAB),
            "triton": lambda key=key: keyed_noise(key, VOCAB),
            "philox_exp": lambda b=b: torch.empty(b, VOCAB, device="cuda").exponential_(),
        }
        for name, fn in sides.items():
            out[f"{name}_{b}_ms"] = round(statistics.mean(harness.gpu_seconds(fn, 50, 3)) * 1e3, 4)
        # each draw written once (fp32), read by the sampler afterwards
        out[f"write_limit_{b}_ms"] = round(b * VOCAB * 4 / limits["copy_bytes_per_s"] * 1e3, 4)
        out[f"torch_over_triton_{b}"] = round(out[f"torch_{b}_ms"] / out[f"triton_{b}_ms"], 1)
    harness.emit("keyed_noise", out, args.save)


if __name__ == "__main__":
    main()
