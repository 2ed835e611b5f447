"""The Megatron backend: the thinker's language model on megatron-core (TP / EP / SP).

Importing this package never imports megatron-core (an optional extra, Python >= 3.12 wheels):
the pure parts — config translation (:mod:`.config_map`) and the HF<->Megatron name table with its
packings (:mod:`.names`) — run anywhere; model building, export and the training step import
megatron-core through :func:`mcore` when first used (``_mcore`` is private to this package;
rigs and tools outside it use the name exported here).
"""

from omni_grpo.backends.megatron._mcore import MegatronUnavailableError, mcore
from omni_grpo.backends.megatron.config_map import (
    MegatronConfigError,
    MegatronModelArgs,
    megatron_model_args,
)
from omni_grpo.backends.megatron.names import NAME_TABLE, NameRule, UnmappedTensorError

__all__ = [
    "NAME_TABLE",
    "MegatronConfigError",
    "MegatronUnavailableError",
    "MegatronModelArgs",
    "NameRule",
    "UnmappedTensorError",
    "mcore",
    "megatron_model_args",
]
