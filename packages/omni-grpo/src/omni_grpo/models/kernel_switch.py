"""Where exact mode may compute with torch's kernels: forwards never compared with the rollout.

Exactness (``rollout.exact_logprobs``) is a property of *one* forward in training: the one whose
logits give the policy logprobs. The recompute of gradient checkpointing (part of the backward:
it rebuilds the decoder layers' activations for the gradients; the logprobs were taken in the
first forward) only has to be right, not bitwise equal to the rollout. (The KL reference's
forward keeps the exact kernels: the KL term then measures the adapters' effect, not a
difference of kernels — ``backends.torch_backend``.)

Inside :func:`torch_kernels` every exact autograd Function (``matmul``, ``grouped``,
``rowwise``, ``attention``, ``moe``) computes its forward with torch's kernels instead of the
row-invariant Triton ones. The Functions save the same tensors (shapes, dtypes) either way, so
torch's non-reentrant checkpoint accepts a recompute under this context
(:func:`recompute_context`: its metadata check compares them). The gradients are then those
of torch's forward at the same weights (they differ from the exact forward's by bf16 rounding,
as any two kernels' do); the logprobs, and so the importance ratios, stay exact.

The flag is thread-local: the recompute runs in the autograd engine's thread, inside the
context that :func:`recompute_context` hands to the checkpoint there.

It lives with the models, a floor below ``omni_grpo.exact``: the thinker's checkpointing hands
:func:`recompute_context` to torch whether exact mode is on or not (off, the flag is read by
nothing), and the exact Functions, installed onto a model from above, read the flag.
``omni_grpo.exact.switch`` serves the same names.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_STATE = threading.local()


def torch_kernels_on() -> bool:
    """Whether the exact Functions compute their forward with torch's kernels here and now."""
    return getattr(_STATE, "depth", 0) > 0


@contextlib.contextmanager
def torch_kernels() -> Iterator[None]:
    """Exact mode's Functions use torch's kernels inside (nestable; a no-op with the option off:
    only the exact Functions read the flag)."""
    _STATE.depth = getattr(_STATE, "depth", 0) + 1
    try:
        yield
    finally:
        _STATE.depth -= 1


def recompute_context() -> tuple[contextlib.AbstractContextManager[None], ...]:
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``: the first
    forward as it is, the recompute under :func:`torch_kernels`."""
    return contextlib.nullcontext(), torch_kernels()
