"""Write server-named thinker weights as a safetensors directory, atomically.

The directory is built under a hidden temporary sibling and renamed into place only when every
shard and the index are on disk, so a server (or a resumed run) never sees a half-written version.
Shards are size-bounded and written while the source streams, so peak memory is one shard.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file

from omni_grpo.atomic_dir import DiskFullError, disk_full_message, is_disk_full

INDEX_NAME = "model.safetensors.index.json"
MANIFEST_NAME = "omni_grpo_weights.json"
DEFAULT_SHARD_BYTES = 2 << 30
_VERSION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def version_dirname(version: str) -> str:
    """The directory name for a weight version (refused when it is not a safe path component)."""
    if not _VERSION_RE.fullmatch(version):
        raise ValueError(
            f"weight version {version!r} cannot name a directory: expected letters, digits, '.', "
            "'_' or '-' (at most 128, not starting with a separator)"
        )
    return version


def write_weights_dir(
    pairs: Iterable[tuple[str, torch.Tensor]],
    dst: Path,
    *,
    version: str,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> dict[str, list]:
    """Write ``pairs`` to ``dst`` (must not exist) as shards + index + manifest; return the manifest.

    The manifest (``omni_grpo_weights.json``) lists name, dtype and shape of every tensor in
    write order, so tests and humans can check what the server was told to load.
    """
    if dst.exists():
        raise FileExistsError(f"weight directory {dst} already exists; refusing to overwrite it")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".tmp-{dst.name}-p{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    total = shard_size = 0
    try:
        weight_map: dict[str, str] = {}
        manifest: list[list] = []
        shard: dict[str, torch.Tensor] = {}
        shard_size = 0
        files: list[str] = []
        total = 0

        def flush() -> None:
            nonlocal shard, shard_size
            fname = f"model-{len(files) + 1:05d}.safetensors"
            save_file(
                {k: v.cpu() for k, v in shard.items()}, str(tmp / fname), metadata={"format": "pt"}
            )
            files.append(fname)
            for k in shard:
                weight_map[k] = fname
            shard, shard_size = {}, 0

        for name, tensor in pairs:
            if name in weight_map or name in shard:
                raise ValueError(f"tensor {name!r} appears twice in the weights to write")
            size = tensor.numel() * tensor.element_size()
            if shard and shard_size + size > shard_bytes:
                flush()
            shard[name] = tensor.contiguous()
            shard_size += size
            total += size
            manifest.append([name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape)])
        if shard:
            flush()
        if not files:
            raise ValueError(f"no tensors to write for weight version {version!r}")
        # Shards are numbered as written; rename to the conventional "-of-N" form now N is known.
        renamed = {
            f: f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i, f in enumerate(files)
        }
        for old, new in renamed.items():
            os.rename(tmp / old, tmp / new)
        index = {
            "metadata": {"total_size": total},
            "weight_map": {k: renamed[v] for k, v in weight_map.items()},
        }
        (tmp / INDEX_NAME).write_text(json.dumps(index, indent=1, sort_keys=True))
        info = {"weight_version": version, "tensors": manifest}
        (tmp / MANIFEST_NAME).write_text(json.dumps(info, indent=1))
        _fsync_dir(tmp)
        os.rename(tmp, dst)
        _fsync_dir(dst.parent)
        return info
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, Exception) and not isinstance(exc, DiskFullError) and is_disk_full(exc):
            raise DiskFullError(
                disk_full_message(
                    f"weight version {version!r}", dst.parent, total + shard_size, at_least=True
                )
            ) from exc
        raise


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
