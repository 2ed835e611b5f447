"""Where exact mode may compute with torch's kernels: the recompute of gradient checkpointing
(see ``omni_grpo.models.kernel_switch``, where the flag is defined).

Defined a floor down because the thinker's checkpointing (``models.thinker``) hands
:func:`recompute_context` to torch, and the models do not import ``omni_grpo.exact``; the
exact Functions read the one thread-local flag through these names.
"""

from omni_grpo.models.kernel_switch import recompute_context, torch_kernels, torch_kernels_on

__all__ = ["recompute_context", "torch_kernels", "torch_kernels_on"]
