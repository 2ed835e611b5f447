"""The continuous decoder's keyed sampling noise per decode step, GPU ms per ``[rows, 151,936]``
block (mean of 50 calls): torch's int64 hash, the one-kernel Triton version
(``omni_grpo.models.noise_kernel``), and torch's Philox exponential (the static decoder's) as the
baseline; the limit is writing the block once at the measured copy rate. Outside the decoder's
CUDA graphs a call also pays its launch: the kernel's figure is an upper bound.
"""

import statistics

import harness
import torch
from omni_grpo.models.continuous import keyed_noise_torch, row_keys
from omni_grpo.models.noise_kernel import keyed_noise

if __name__ == "__main__":
    args, V = harness.parser(__doc__, rows=[64, 256]).parse_args(), 151936
    copy_rate = harness.device_limits("cuda")["copy_bytes_per_s"]
    out: dict[str, float] = {"copy_bytes_per_s": copy_rate}
    for b in args.rows:
        key = row_keys(3, torch.arange(b, device="cuda"), torch.arange(b, device="cuda"))
        out[f"torch_{b}_ms"], out[f"triton_{b}_ms"], out[f"philox_exp_{b}_ms"] = (
            round(statistics.mean(harness.gpu_seconds(fn, 50, 3)) * 1e3, 4)
            for fn in (
                lambda: keyed_noise_torch(key, V),  # noqa: B023 (called within the iteration)
                lambda: keyed_noise(key, V),  # noqa: B023
                lambda: torch.empty(b, V, device="cuda").exponential_(),  # noqa: B023
            )
        )
        out[f"torch_over_triton_{b}"] = round(out[f"torch_{b}_ms"] / out[f"triton_{b}_ms"], 1)
        out[f"write_limit_{b}_ms"] = round(b * V * 4 / copy_rate * 1e3, 4)  # fp32, written once
    harness.emit("keyed_noise", out, args.save)
