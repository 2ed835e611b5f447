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


def tensor_nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    """Bytes of a dense tensor of ``dtype`` and ``shape``: what safetensors' data offsets count."""
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


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
        return tensor_nbytes(self.dtype, self.shape)


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


# Sizes every thinker tensor shape is derived from: each must be given as a positive integer.
# Without one, transformers would substitute its own default (2048 for ``hidden_size``) and the
# first tensor checked would be reported with a wrong "expected" shape instead.
REQUIRED_SIZES: dict[str, tuple[str, ...]] = {
    "text_config": (
        "hidden_size",
        "intermediate_size",
        "moe_intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "num_experts",
        "num_experts_per_tok",
        "vocab_size",
    ),
    "vision_config": (
        "depth",
        "hidden_size",
        "intermediate_size",
        "num_heads",
        "patch_size",
        "spatial_merge_size",
        "temporal_patch_size",
        "out_hidden_size",
    ),
    "audio_config": (
        "d_model",
        "encoder_layers",
        "encoder_attention_heads",
        "encoder_ffn_dim",
        "num_mel_bins",
        "output_dim",
    ),
}
# Sizes that may be absent (transformers derives them) but must be positive integers if given.
OPTIONAL_SIZES: dict[str, tuple[str, ...]] = {"text_config": ("head_dim",)}


def load_json(path: Path, error: type[Exception], expect: type = dict) -> Any:
    """Parse a JSON file of a checkpoint; ``error`` names the file and what is wrong with it."""
    try:
        value = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise error(
            f"{path}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
        ) from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"{path}: unreadable ({exc})") from exc
    if not isinstance(value, expect):
        raise error(
            f"{path}: expected a JSON {expect.__name__ if expect is not dict else 'object'}, got {type(value).__name__}"
        )
    return value


def _is_size(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def check_sizes(path: Path, thinker: dict[str, Any]) -> None:
    """Every size the tensor shapes depend on is present and a positive integer."""
    for sub, keys in REQUIRED_SIZES.items():
        for key in keys:
            if key not in thinker[sub]:
                raise NotQwen3OmniError(
                    f"{path}: thinker_config.{sub}.{key} is missing (the shapes of the "
                    f"{sub.removesuffix('_config')} tensors are derived from it)"
                )
    for table in (REQUIRED_SIZES, OPTIONAL_SIZES):
        for sub, keys in table.items():
            for key in keys:
                if key in thinker[sub] and not _is_size(thinker[sub][key]):
                    raise NotQwen3OmniError(
                        f"{path}: thinker_config.{sub}.{key} must be a positive integer, "
                        f"got {thinker[sub][key]!r}"
                    )


def load_omni_config(root: Path) -> dict[str, Any]:
    """Read ``config.json`` and insist it is a Qwen3-Omni checkpoint with a full thinker config."""
    path = root / "config.json"
    if not path.is_file():
        raise NotQwen3OmniError(f"{path}: no config.json (is {root} a checkpoint directory?)")
    config = load_json(path, NotQwen3OmniError)
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
    check_sizes(path, thinker)
    return config


def load_weight_map(index: Path) -> dict[str, str]:
    """``weight_map`` of a shard index: a non-empty object of tensor name -> shard file name."""
    raw = load_json(index, MissingShardError)
    weight_map = raw.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        got = type(weight_map).__name__ if weight_map else "empty or missing"
        raise MissingShardError(
            f"{index}: 'weight_map' must be a non-empty object of tensor name -> shard file ({got})"
        )
    bad = next(
        ((k, v) for k, v in weight_map.items() if not isinstance(v, str) or not v),
        None,
    )
    if bad is not None:
        raise MissingShardError(
            f"{index}: weight_map[{bad[0]!r}] must be a shard file name, got {bad[1]!r}"
        )
    return weight_map


def _shard_files(root: Path) -> tuple[str, ...]:
    """The shard files the checkpoint consists of; every file the index lists must exist."""
    index = root / INDEX_FILE
    if index.is_file():
        weight_map = load_weight_map(index)
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
    size = path.stat().st_size
    with open(path, "rb") as fh:
        header_len = int.from_bytes(fh.read(8), "little")
        if header_len > size - 8:  # a garbled length would otherwise be read (MemoryError)
            raise ValueError(f"header length {header_len} exceeds the file size {size}")
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
    weight_map = load_weight_map(index)
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
