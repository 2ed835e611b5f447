"""What every weight sync shares: the ``WeightSync`` interface, its report, and the name pass.

A sync takes the trainer's weights as ``(name, tensor)`` pairs in ANY source naming omni-extract's
table knows (pseudo-VL ``model.language_model.*``, text ``model.*``, transformers' in-memory
thinker names, or server names), plus the layout flag saying how fused experts are held:

* ``"hf_memory"`` — a transformers model (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``);
* ``"vl_hub"``    — the Qwen3-VL hub layout (``[E, H, 2I]`` / ``[E, I, H]``), e.g. a Megatron-Bridge
  HF export or tensors read from our pseudo-VL files.

The layout cannot be inferred from shapes (the square-shape trap), so callers say it. Names go
through ``omni_extract.names.to_server_tensors`` — the ONE mapping table — which renames to the
hub names the sglang-omni thinker stage loads and transposes fused experts to the VL hub layout
the stage expects. Unknown names raise before anything is sent; tower tensors (vision, audio) are
skipped and counted, because the server's encoder stages cannot be refit (contract §4.7).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from omni_extract import names as omni_names
from omni_extract.errors import FrozenTensorError

# declared with the seams in omni_grpo.types (a backend's ``weights_for_sync`` returns the weights;
# an in-process engine can be its own WeightSync): re-exported here, the sync package's face
from omni_grpo.types import NamedTensors, SourceLayout, WeightSyncError
from omni_grpo.types import SyncReport as SyncReport
from omni_grpo.types import WeightSync as WeightSync

log = logging.getLogger(__name__)


def close_clients(clients: Iterable[Any], loop: Any, *, owns_loop: bool) -> None:
    """Close a sync's HTTP clients on its event loop, then the loop itself if the sync started it.

    A sync built by ``make_weight_sync`` owns its clients (it made them from the config) and owns
    the loop unless the caller passed one in; its ``close`` ends with this.
    """

    async def aclose_all() -> None:
        for client in clients:
            await client.aclose()

    try:
        loop.run(aclose_all(), 30)
    finally:
        if owns_loop:
            loop.close()


def _pairs(named_tensors: NamedTensors) -> Iterable[tuple[str, torch.Tensor]]:
    return named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors


def check_names(named_tensors: NamedTensors) -> None:
    """Fail loud on any unmapped name BEFORE anything is paused or sent, when names are known.

    A ``Mapping`` (a state dict) exposes every name without materialising tensors, so it is
    checked whole. A plain iterator (e.g. a Megatron export that gathers on demand) cannot be
    pre-read without holding the whole model; it is checked bucket by bucket instead, still
    before each bucket's first byte goes out.
    """
    if not isinstance(named_tensors, Mapping):
        return
    for name in named_tensors:
        _server_name_or_none(name)


def _server_name_or_none(name: str) -> str | None:
    """The server name, or None for a tower tensor; raises ``UnmappedTensorError`` otherwise."""
    try:
        return omni_names.to_server_name(name)
    except FrozenTensorError:
        return None


@dataclass
class ServerTensors:
    """Iterator of ``(server_name, tensor)`` that counts what it yields and what it skipped."""

    source: NamedTensors
    layout: SourceLayout
    dtype: torch.dtype | None = None
    tensors: int = 0
    bytes: int = 0
    skipped_towers: int = 0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self.layout not in ("hf_memory", "vl_hub"):
            raise ValueError(f"layout must be 'hf_memory' or 'vl_hub', got {self.layout!r}")
        seen: set[str] = set()
        for name, tensor in _pairs(self.source):
            if _server_name_or_none(name) is None:
                self.skipped_towers += 1
                continue
            for server_name, out in omni_names.to_server_tensors(
                [(name, tensor)], self.layout, towers="error"
            ):
                if server_name in seen:
                    raise WeightSyncError(
                        f"two source tensors map to the server name {server_name!r} (second: "
                        f"{name!r}); mixing naming families in one push would overwrite weights"
                    )
                seen.add(server_name)
                out = out.detach()
                if self.dtype is not None and out.is_floating_point():
                    out = out.to(self.dtype)
                out = out.contiguous()
                self.tensors += 1
                self.bytes += out.numel() * out.element_size()
                yield server_name, out
        if self.tensors == 0:
            raise WeightSyncError(
                "weight sync got zero server tensors (after skipping "
                f"{self.skipped_towers} tower tensors): refusing to bump the version with no weights"
            )


def dtype_name(dtype: torch.dtype) -> str:
    """Torch dtype name as sglang's update routes spell it (``"bfloat16"``, no ``torch.``)."""
    return str(dtype).removeprefix("torch.")


class LogOnce:
    """Log a message the first time only (skip mode is called every step)."""

    def __init__(self) -> None:
        self._done = False

    def __call__(self, msg: str, *args: object) -> None:
        if not self._done:
            self._done = True
            log.warning(msg, *args)
