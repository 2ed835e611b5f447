"""Fused experts are transposed straight from read-only maps of the input shards."""

from __future__ import annotations

import os
import re
import shutil

import numpy as np
import pytest
import torch
from omni_extract import convert, extract
from omni_extract.errors import CorruptShardError
from omni_extract.plan import build_plan
from omni_extract.source import open_source


def _read_into_buffer(dst, inputs, src, dtype):
    """A plain reference: ``pread`` a fresh tensor, ``.T.contiguous()``, copy its bits."""
    t = inputs.read(src).to(dtype).T.contiguous()
    np.copyto(dst, t.view({2: torch.int16, 4: torch.int32}[t.element_size()]).numpy())


@pytest.mark.parametrize(
    ("shard_size", "dtype"), [("100KB", "keep"), ("5GB", "keep"), ("5GB", "fp32")]
)
def test_mapped_paths_write_the_same_bytes_as_buffered_reads(
    tiny_omni_dir, tmp_path, monkeypatch, shard_size, dtype
):
    """Mapped input, mapped output, in-place transpose == pread + torch transpose, byte for byte."""
    kw = {"variant": "vl", "shard_size": shard_size, "dtype": dtype}
    mapped = extract(tiny_omni_dir, tmp_path / "mapped", **kw)
    monkeypatch.setattr(convert, "_transpose_part", _read_into_buffer)
    buffered = extract(tiny_omni_dir, tmp_path / "buffered", **kw)
    assert mapped.shards == buffered.shards
    for name in mapped.shards:
        assert (mapped.dst / name).read_bytes() == (buffered.dst / name).read_bytes(), name


def test_expert_matrices_are_mapped_not_read(tiny_omni_dir, tmp_path, monkeypatch):
    """With no dtype change, no expert matrix goes through ``pread`` (the copy we removed)."""
    reads: list[str] = []
    real_read = convert.SourceInputs.read

    def spy(self, src, into=None):
        reads.append(src.name)
        return real_read(self, src, into)

    monkeypatch.setattr(convert.SourceInputs, "read", spy)
    extract(tiny_omni_dir, tmp_path / "vl", variant="vl")
    assert not [n for n in reads if ".experts." in n]


def test_shard_truncated_after_validation_names_the_file(tiny_omni_dir, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(tiny_omni_dir, src)
    source = open_source(src)
    plan = build_plan(source, "vl", "keep", 10**9)
    fused = next(o for o in plan.outputs if o.source is None)
    part = fused.parts[-1][0]
    os.truncate(src / part.file, part.offset + 1)
    inputs = convert.SourceInputs(source.root, source.files)
    try:
        pattern = rf"{re.escape(part.file)}: tensor '{re.escape(part.name)}'.*truncated"
        with pytest.raises(CorruptShardError, match=pattern):
            inputs.mapped(part)
    finally:
        inputs.close()
