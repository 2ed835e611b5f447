"""What the thinker tensors of a checkpoint MUST be, derived from its own config.

We instantiate transformers' ``Qwen3OmniMoeThinkerForConditionalGeneration`` on the ``meta``
device (no memory, ~0.1 s for the 30B model) and translate its parameter names back to hub names
through the name table. That gives the exact set of hub names and shapes the config implies, so a
truncated shard, a missing expert or a wrongly shaped tensor is caught before anything is written,
and nobody maintains a second, hand-written shape table.
"""

from __future__ import annotations

from typing import Any

import torch

from omni_extract.errors import NotQwen3OmniError, UnmappedTensorError
from omni_extract.names import NAME_TABLE, match_in_memory

# Per-expert rows by the fused tensor they come from, and how a fused shape splits into them.
_EXPERT_ROWS = {row.fuse: row for row in NAME_TABLE if row.fuse is not None}
_SPLIT: dict[str, tuple[str, ...]] = {"gate_up": ("gate", "up"), "down": ("down",)}


def _per_expert_shape(fused: str, shape: tuple[int, ...]) -> tuple[int, int]:
    # in memory: gate_up [E, 2I, H] -> gate/up [I, H]; down [E, H, I] -> down [H, I]
    if fused == "gate_up":
        return (shape[1] // 2, shape[2])
    return (shape[1], shape[2])


def expected_thinker_tensors(thinker_config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Hub name -> shape for every thinker tensor the config implies (experts per-expert)."""
    from transformers import (
        Qwen3OmniMoeThinkerConfig,
        Qwen3OmniMoeThinkerForConditionalGeneration,
    )

    try:
        cfg = Qwen3OmniMoeThinkerConfig(**thinker_config)
        with torch.device("meta"):
            model = Qwen3OmniMoeThinkerForConditionalGeneration._from_config(cfg)
    except Exception as exc:  # a config transformers cannot build is not a usable Omni config
        raise NotQwen3OmniError(
            f"config.json thinker_config does not build a thinker: {exc}"
        ) from exc
    out: dict[str, tuple[int, ...]] = {}
    for name, tensor in model.state_dict().items():
        found = match_in_memory(name)
        if found is None:
            raise UnmappedTensorError(
                f"transformers' thinker has a parameter {name!r} that omni_extract.names does not "
                "know (newer transformers?)"
            )
        shape = tuple(tensor.shape)
        if found.row.fused is None:
            hub = found.name_in("hub")
            if hub is None:
                raise UnmappedTensorError(f"{name!r} ({found.row.key}) has no hub name")
            out[hub] = shape
            continue
        per_expert = _per_expert_shape(found.row.fused, shape)
        for expert in range(shape[0]):
            for part in _SPLIT[found.row.fused]:
                row = _EXPERT_ROWS[part]
                assert row.hub is not None
                out[row.hub.format(expert=expert, **found.groups)] = per_expert
    return out
