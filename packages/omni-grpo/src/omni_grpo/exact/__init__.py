"""Exactly on-policy logprobs on the embedded engine (``rollout.exact_logprobs``).

The embedded engine samples from the trainer's own module, so the rollout's and the trainer's
logprobs differ only where a kernel's arithmetic depends on the shape it is given: a decode step
computes one new row per sequence against a KV cache, the trainer every row of a micro-batch at
once. Exact mode replaces, in the text model and the LM head, every such kernel's forward with
one whose per-row result does not depend on the other rows (``matmul``, ``grouped``,
``attention``, ``rowwise``, ``moe``), and encodes each media item alone (``towers``). Backward
passes keep torch's kernels. See docs/exact-logprobs.md.

Only ``install`` is imported here: the kernel modules import Triton, loaded on first use.
"""

from omni_grpo.exact.install import (
    ExactLogprobsUnsupported,
    check_supported,
    enable_exact_logprobs,
    is_exact,
)

__all__ = ["ExactLogprobsUnsupported", "check_supported", "enable_exact_logprobs", "is_exact"]
