"""Helpers to rewrite a tiny checkpoint into a corrupted or re-sharded copy."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


def _read_checkpoint(ckpt: Path) -> dict[str, torch.Tensor]:
    index = ckpt / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    out = {}
    for fname in files:
        with safe_open(ckpt / fname, "pt") as f:
            for k in f.keys():  # noqa: SIM118 - safe_open is not iterable
                out[k] = f.get_tensor(k)
    return out


def rewrite_checkpoint(
    src: Path,
    dst: Path,
    edit: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] = lambda t: t,
    shard_of: Callable[[str, int], int] | None = None,
) -> Path:
    """Copy ``src`` to ``dst`` with its tensors passed through ``edit`` and re-sharded by ``shard_of``."""
    dst.mkdir(parents=True)
    for p in src.iterdir():
        if p.is_file() and not p.name.startswith("model"):
            shutil.copyfile(p, dst / p.name)
    tensors = edit(_read_checkpoint(src))
    names = list(tensors)
    assign = shard_of or (lambda name, i: 3 * i // len(names))
    groups: dict[int, dict[str, torch.Tensor]] = {}
    for i, name in enumerate(names):
        groups.setdefault(assign(name, i), {})[name] = tensors[name].contiguous()
    n = len(groups)
    weight_map = {}
    for k, idx in enumerate(sorted(groups)):
        fname = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        save_file(groups[idx], dst / fname, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(groups[idx], fname))
    (dst / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    return dst


@pytest.fixture
def rewrite(tiny_omni_dir, tmp_path):
    """``rewrite(edit=..., shard_of=...)`` -> a modified copy of the tiny 3-shard checkpoint."""
    counter = iter(range(1000))

    def make(**kw) -> Path:
        return rewrite_checkpoint(tiny_omni_dir, tmp_path / f"src{next(counter)}", **kw)

    return make


@pytest.fixture
def read_checkpoint() -> Callable[[Path], dict[str, torch.Tensor]]:
    """``read_checkpoint(dir)`` -> every tensor of a (sharded) safetensors checkpoint."""
    return _read_checkpoint
