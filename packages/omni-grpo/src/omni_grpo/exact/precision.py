"""The dtype of the exact linear layers' and experts' operands.

bf16 on the GPU (autocast's rule, and the only dtype ``rollout.exact_logprobs`` accepts). The
CPU tests run the kernels in Triton's interpreter on a float32 model and set float32 here; it is
read at every call, so a test can change it for its duration.
"""

from __future__ import annotations

import torch

COMPUTE_DTYPE = torch.bfloat16
