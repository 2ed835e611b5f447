"""The one place that imports megatron-core (optional extra, Python >= 3.12 wheels only).

Everything else in this package reaches megatron through :func:`mcore`, so importing
``omni_grpo.backends.megatron`` never fails on a machine without megatron-core: only building the
model does, with an error that says how to install it.
"""

from __future__ import annotations

import functools
import warnings
from types import SimpleNamespace


class MegatronUnavailableError(ImportError):
    pass


@functools.cache
def mcore() -> SimpleNamespace:
    """Import megatron-core lazily; returns a namespace of the symbols we use."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "TE/Apex not installed" fallbacks are expected
            from megatron.core import parallel_state, tensor_parallel
            from megatron.core.models.gpt import GPTModel
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
            from megatron.core.tensor_parallel import (
                gather_from_sequence_parallel_region,
                gather_from_tensor_model_parallel_region,
                model_parallel_cuda_manual_seed,
                reduce_from_tensor_model_parallel_region,
                vocab_parallel_cross_entropy,
            )
            from megatron.core.transformer import TransformerConfig
            from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    except ImportError as exc:  # pragma: no cover - depends on the machine
        from omni_grpo.extras import install_hint

        raise MegatronUnavailableError(
            "trainer.backend 'megatron' needs megatron-core (Python >= 3.12), which is in the "
            f"'megatron' extra: {install_hint('megatron')} (plus triton, which megatron-core "
            f"imports but does not declare); import failed with: {exc}"
        ) from exc
    return SimpleNamespace(
        parallel_state=parallel_state,
        tensor_parallel=tensor_parallel,
        GPTModel=GPTModel,
        get_gpt_layer_local_spec=get_gpt_layer_local_spec,
        TransformerConfig=TransformerConfig,
        TransformerBlockSubmodules=TransformerBlockSubmodules,
        gather_from_sequence_parallel_region=gather_from_sequence_parallel_region,
        gather_from_tensor_model_parallel_region=gather_from_tensor_model_parallel_region,
        model_parallel_cuda_manual_seed=model_parallel_cuda_manual_seed,
        vocab_parallel_cross_entropy=vocab_parallel_cross_entropy,
        reduce_from_tensor_model_parallel_region=reduce_from_tensor_model_parallel_region,
    )


def available() -> bool:
    try:
        mcore()
    except ImportError:
        return False
    return True
