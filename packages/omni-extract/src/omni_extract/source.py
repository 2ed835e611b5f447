"""Reading a Qwen3-Omni hub checkpoint lazily: its config, its shard index and tensor headers.

Only safetensors headers are read here (``safe_open`` validates each file and lists dtypes and
shapes without touching tensor data), so planning an extraction of the 65 GB release costs a few
megabytes. We also record each tensor's absolute byte offset (from the same JSON header), because
the stream then reads tensor bytes with ``pread``/``sendfile`` instead of through a memory map:
mapped pages would count towards RSS and cost one more copy (see ``convert.py``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from omni_extract.errors import (
    CorruptShardError,
    MissingShardError,
    NotQwen3OmniError,
    TensorMismatchError,
)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
OMNI_MODEL_TYPE = "qwen3_omni_moe"
THINKER_SUBCONFIGS = ("text_config", "vision_config", "audio_config")

# safetensors dtype tags <-> torch dtypes of the floating types a weight may have.
ST_TO_TORCH: dict[str, torch.dtype] = {
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F64": torch.float64,
}
TORCH_TO_ST: dict[torch.dtype, str] = {v: k for k, v in ST_TO_TORCH.items()}


@dataclass(frozen=True)
class SourceTensor:
    """Where one hub tensor lives and what its header says."""

    name: str
    file: str  # shard file name, relative to the checkpoint directory
    file_index: int  # position of the shard in sorted order (the streaming order)
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the tensor data in ``file``

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class OmniSource:
    """A validated Qwen3-Omni checkpoint directory, ready to be streamed."""

    root: Path
    config: dict[str, Any]
    files: tuple[str, ...]
    tensors: dict[str, SourceTensor]

    @property
    def thinker_config(self) -> dict[str, Any]:
        return self.config["thinker_config"]


def load_omni_config(root: Path) -> dict[str, Any]:
    """Read ``config.json`` and insist it is a Qwen3-Omni checkpoint with a full thinker config."""
    path = root / "config.json"
    if not path.is_file():
        raise NotQwen3OmniError(f"{path}: no config.json (is {root} a checkpoint directory?)")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise NotQwen3OmniError(f"{path}: not valid JSON ({exc})") from exc
    model_type = config.get("model_type")
    if model_type != OMNI_MODEL_TYPE:
        raise NotQwen3OmniError(
            f"{path}: model_type is {model_type!r}, expected {OMNI_MODEL_TYPE!r} "
            "(the Qwen3-Omni hub checkpoint, e.g. Qwen/Qwen3-Omni-30B-A3B-Instruct)"
        )
    thinker = config.get("thinker_config")
    if not isinstance(thinker, dict):
        raise NotQwen3OmniError(f"{path}: field 'thinker_config' missing or not an object")
    for sub in THINKER_SUBCONFIGS:
        if not isinstance(thinker.get(sub), dict):
            raise NotQwen3OmniError(
                f"{path}: field 'thinker_config.{sub}' missing or not an object"
            )
    return config


def _shard_files(root: Path) -> tuple[str, ...]:
    """The shard files the checkpoint consists of; every file the index lists must exist."""
    index = root / INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text()).get("weight_map") or {}
        if not weight_map:
            raise MissingShardError(f"{index}: empty or missing 'weight_map'")
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (root / f).is_file()]
        if missing:
            raise MissingShardError(
                f"{index} lists {len(missing)} shard(s) that do not exist in {root}: {missing}"
            )
        return tuple(files)
    if (root / SINGLE_FILE).is_file():
        return (SINGLE_FILE,)
    raise MissingShardError(f"{root}: neither {INDEX_FILE} nor {SINGLE_FILE} found")


def _data_offsets(path: Path) -> dict[str, int]:
    """Absolute data offset of every tensor, from the safetensors header (u64 length + JSON)."""
    with open(path, "rb") as fh:
        header_len = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(header_len))
    base = 8 + header_len
    return {k: base + v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}


def _read_headers(root: Path, files: tuple[str, ...]) -> dict[str, SourceTensor]:
    tensors: dict[str, SourceTensor] = {}
    for i, fname in enumerate(files):
        try:
            tensors.update(_read_header(root, fname, i, tensors))
        except (SafetensorError, OSError, ValueError, KeyError) as exc:
            raise CorruptShardError(
                f"{root / fname}: not a readable safetensors file ({exc})"
            ) from exc
    return tensors


def _read_header(
    root: Path, fname: str, i: int, seen: dict[str, SourceTensor]
) -> dict[str, SourceTensor]:
    tensors: dict[str, SourceTensor] = {}
    offsets = _data_offsets(root / fname)
    with safe_open(root / fname, framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
            sl = f.get_slice(name)
            tag = sl.get_dtype()
            if tag not in ST_TO_TORCH:
                raise TensorMismatchError(
                    f"{fname}: tensor {name!r} has dtype {tag}, expected a floating type "
                    f"({', '.join(ST_TO_TORCH)})"
                )
            if name in seen:
                raise TensorMismatchError(
                    f"tensor {name!r} appears in both {seen[name].file} and {fname}"
                )
            tensors[name] = SourceTensor(
                name, fname, i, ST_TO_TORCH[tag], tuple(sl.get_shape()), offsets[name]
            )
    return tensors


def _check_index_agrees(root: Path, tensors: dict[str, SourceTensor]) -> None:
    index = root / INDEX_FILE
    if not index.is_file():
        return
    weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
    for name, fname in weight_map.items():
        found = tensors.get(name)
        if found is None:
            raise MissingShardError(
                f"{index}: tensor {name!r} is listed in {fname} but not stored there"
            )
        if found.file != fname:
            raise MissingShardError(
                f"{index}: tensor {name!r} is listed in {fname} but stored in {found.file}"
            )


def open_source(src: str | os.PathLike[str]) -> OmniSource:
    """Validate ``src`` (config, index, every shard header) without reading tensor data."""
    root = Path(src)
    if not root.is_dir():
        raise NotQwen3OmniError(f"{root}: not a directory")
    config = load_omni_config(root)
    files = _shard_files(root)
    tensors = _read_headers(root, files)
    _check_index_agrees(root, tensors)
    return OmniSource(root=root, config=config, files=files, tensors=tensors)
