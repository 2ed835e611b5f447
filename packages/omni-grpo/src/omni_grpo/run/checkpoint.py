"""Atomic, resumable checkpoints: ``<run>/checkpoints/step_000010/`` holding everything a resume
needs to continue exactly where an uninterrupted run would be.

Contents: trainable weights (``model.safetensors``; frozen parts come back from the model
directory), optimizer state (``optimizer.pt``), RNG states of python / numpy / torch (+ CUDA)
(``rng.pt``), and ``state.json`` (step, data cursor = epoch + position in that epoch's order, the
warm-up flag, free-form extras). A checkpoint is written into a temporary sibling directory,
fsynced, and renamed into place; ``latest`` is then replaced atomically. A crash at any point leaves
either the previous checkpoint or the new one, never a half-written directory that looks valid
(``state.json`` is written last and a directory without it is ignored).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from omni_grpo.atomic_dir import (
    DiskFullError,
    check_free_space,
    disk_full_message,
    is_disk_full,
    staged_dir,
)

STATE_FILE = "state.json"
LATEST = "latest"
FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or does not match the run; the message names the path."""


@dataclass
class DataCursor:
    """Where the training data stream stands: the epoch and the position inside its order.

    The order of epoch ``e`` is a pure function of (seed, e, dataset size), so the cursor alone
    reproduces the remaining stream after a resume — no sampler RNG state needed.
    """

    epoch: int = 0
    position: int = 0


@dataclass
class TrainState:
    step: int = 0
    cursor: DataCursor = field(default_factory=DataCursor)
    warmup_done: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def rng_state() -> dict[str, Any]:
    """Every RNG the run draws from (rollout sampling uses torch's global generator)."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    for p in path.iterdir():
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(path)


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def checkpoint_bytes(weights: dict[str, torch.Tensor], optimizer: Any) -> int:
    """What a checkpoint takes on disk, about: its tensors plus 1 MiB of metadata and RNG state."""
    return _tensor_bytes(weights) + _tensor_bytes(optimizer) + (1 << 20)


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:06d}"


def save_checkpoint(
    run_dir: str | os.PathLike[str],
    state: TrainState,
    weights: dict[str, torch.Tensor],
    optimizer: dict[str, Any],
    rng: dict[str, Any] | None = None,
    keep_last: int = 2,
    extra: Callable[[Path], None] | None = None,
) -> Path:
    """Write the checkpoint for ``state.step`` atomically and point ``latest`` at it.

    ``extra`` writes more files into the staged directory before it is published (e.g. a LoRA
    run's adapter in peft's format), so they are part of the same atomic checkpoint.

    Older checkpoints beyond ``keep_last`` are removed only after the new one is in place.
    """
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = checkpoint_dir(Path(run_dir), state.step)
    needed = checkpoint_bytes(weights, optimizer)
    # Refuse up front rather than fill the disk and fail half-way through.
    check_free_space(f"checkpoint {final.name}", root, needed)
    try:
        # replace_existing: re-saving the same step (e.g. the final save after a periodic one).
        with staged_dir(final, replace_existing=True) as tmp:
            save_file(
                {k: v.contiguous() for k, v in weights.items()}, str(tmp / "model.safetensors")
            )
            torch.save(optimizer, tmp / "optimizer.pt")
            torch.save(rng if rng is not None else rng_state(), tmp / "rng.pt")
            if extra is not None:
                extra(tmp)
            payload = {"format": FORMAT_VERSION, **asdict(state)}
            (tmp / STATE_FILE).write_text(json.dumps(payload, indent=2))
            _fsync_tree(tmp)
    except Exception as exc:  # the temp dir is gone (staged_dir); say why the write failed
        if is_disk_full(exc):  # staged_dir's own DiskFullError too: we know the size needed
            cause = exc.__cause__ if isinstance(exc, DiskFullError) and exc.__cause__ else exc
            raise DiskFullError(
                disk_full_message(f"checkpoint {final.name}", root, needed)
            ) from cause
        raise
    _fsync_dir(root)
    pointer_tmp = root / f".{LATEST}.tmp"
    pointer_tmp.write_text(final.name + "\n")
    os.replace(pointer_tmp, root / LATEST)
    _fsync_dir(root)
    complete = sorted(p for p in root.glob("step_*") if (p / STATE_FILE).is_file())
    for old in complete[:-keep_last] if keep_last > 0 else []:
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint (``latest`` pointer, else the highest complete step dir)."""
    root = Path(run_dir) / "checkpoints"
    pointer = root / LATEST
    if pointer.is_file():
        candidate = root / pointer.read_text().strip()
        if (candidate / STATE_FILE).is_file():
            return candidate
    complete = sorted(p for p in root.glob("step_*") if (p / STATE_FILE).is_file())
    return complete[-1] if complete else None


def damaged(path: Path, what: str) -> CheckpointError:
    """The error for a checkpoint directory that cannot be loaded: names it, what is wrong, and
    the way out — the previous complete checkpoint (after removing this one) or ``--overwrite``.

    A checkpoint is published atomically, so damage comes from outside the run (a disk error, a
    copy cut short, a hand edit); no automatic fallback silently trains from an older step."""
    path = Path(path)
    older = sorted(
        p
        for p in path.parent.glob("step_*")
        if p.name < path.name and p.is_dir() and (p / STATE_FILE).is_file()
    )
    if older:
        way = (
            f"delete it (rm -r {path}) and rerun with --resume to continue from the previous "
            f"complete checkpoint {older[-1].name}, or start over with --overwrite"
        )
    else:
        way = "there is no earlier checkpoint: start over with --overwrite (or another run.dir)"
    return CheckpointError(f"checkpoint {path} is damaged ({what}); {way}")


def _one_line(err: BaseException) -> str:
    text = "; ".join(line.strip() for line in str(err).splitlines() if line.strip())
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def read_state(path: Path) -> dict[str, Any]:
    """``state.json`` of checkpoint ``path``, checked for what a resume reads from it."""
    state_file = Path(path) / STATE_FILE
    if not state_file.is_file():
        raise CheckpointError(f"{path}: not a complete checkpoint (no {STATE_FILE})")
    try:
        raw = json.loads(state_file.read_text())
        if not isinstance(raw, dict):
            raise ValueError(f"a JSON {type(raw).__name__}, not an object")
    except (OSError, ValueError) as err:
        raise damaged(path, f"{STATE_FILE}: {_one_line(err)}") from None
    if raw.get("format") != FORMAT_VERSION:
        raise CheckpointError(
            f"{state_file}: format {raw.get('format')!r}, expected {FORMAT_VERSION}"
        )
    try:
        int(raw["step"])
        DataCursor(**raw["cursor"])
    except (KeyError, TypeError, ValueError) as err:
        raise damaged(path, f"{STATE_FILE}: {_one_line(err)}") from None
    return raw


def verify_checkpoint(path: str | os.PathLike[str]) -> None:
    """Check, without loading the tensors, that every file a resume loads is whole: the state,
    the safetensors header and the data it covers, the zip directories of the torch files. A
    resume checks the newest checkpoint this way before anything is prepared."""
    path = Path(path)
    read_state(path)
    for name in ("model.safetensors", "optimizer.pt", "rng.pt"):
        if not (path / name).is_file():
            raise damaged(path, f"{name} is missing")
    try:
        from safetensors import safe_open

        with safe_open(str(path / "model.safetensors"), framework="pt") as f:
            f.keys()
    except Exception as err:  # noqa: BLE001 - SafetensorError, OSError: the file is not whole
        raise damaged(path, f"model.safetensors: {_one_line(err)}") from None
    import zipfile

    for name in ("optimizer.pt", "rng.pt"):
        try:
            with zipfile.ZipFile(path / name) as z:
                size = (path / name).stat().st_size
                if any(i.header_offset + i.compress_size > size for i in z.infolist()):
                    raise zipfile.BadZipFile("an entry extends past the end of the file")
        except (zipfile.BadZipFile, OSError) as err:
            raise damaged(path, f"{name}: {_one_line(err)}") from None


def load_checkpoint(
    path: str | os.PathLike[str],
) -> tuple[TrainState, dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """(state, trainable weights, optimizer state, rng state) of a complete checkpoint directory.

    A file that is missing or cannot be read is a :class:`CheckpointError` naming the checkpoint
    and the way out (:func:`damaged`), never the loader's own exception."""
    path = Path(path)
    raw = read_state(path)
    for name in ("model.safetensors", "optimizer.pt", "rng.pt"):
        if not (path / name).is_file():
            raise damaged(path, f"{name} is missing")
    state = TrainState(
        step=int(raw["step"]),
        cursor=DataCursor(**raw["cursor"]),
        warmup_done=bool(raw.get("warmup_done", False)),
        extra=dict(raw.get("extra", {})),
    )
    name = "model.safetensors"
    try:
        weights = load_file(str(path / name))
        name = "optimizer.pt"
        optimizer = torch.load(path / name, map_location="cpu", weights_only=False)
        name = "rng.pt"
        rng = torch.load(path / name, map_location="cpu", weights_only=False)
    except Exception as err:  # noqa: BLE001 - whatever the loaders raise for a damaged file
        raise damaged(path, f"{name}: {_one_line(err)}") from None
    return state, weights, optimizer, rng
