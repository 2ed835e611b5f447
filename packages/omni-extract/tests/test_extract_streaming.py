"""Streaming mechanics: straddling experts, output format, atomic install, interruption."""

from __future__ import annotations

import json
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from omni_extract import extract
from omni_extract.convert import parse_size
from omni_extract.errors import DestinationExistsError, ExtractError
from safetensors import safe_open


def test_experts_straddling_shards_fuse_like_one_shard(
    rewrite, read_checkpoint, tiny_omni_dir, tmp_path
):
    # every layer's experts alternate between two shards, with other tensors in a third
    def shard_of(name, i):
        m = re.search(r"experts\.(\d+)\.", name)
        return int(m.group(1)) % 2 if m else 2

    src = rewrite(shard_of=shard_of)
    straddled = extract(src, tmp_path / "a", variant="vl", shard_size="100KB")
    reference = extract(tiny_omni_dir, tmp_path / "b", variant="vl")
    got, want = read_checkpoint(straddled.dst), read_checkpoint(reference.dst)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_fused_layout_is_vl_hub(tiny_omni_dir, tmp_path, read_checkpoint):
    out = read_checkpoint(extract(tiny_omni_dir, tmp_path / "vl", variant="vl").dst)
    hub = read_checkpoint(tiny_omni_dir)
    gate_up = out["model.language_model.layers.1.mlp.experts.gate_up_proj"]
    down = out["model.language_model.layers.1.mlp.experts.down_proj"]
    e, i = 3, hub["thinker.model.layers.1.mlp.experts.3.gate_proj.weight"].shape[0]
    assert torch.equal(
        gate_up[e, :, :i], hub["thinker.model.layers.1.mlp.experts.3.gate_proj.weight"].T
    )
    assert torch.equal(
        gate_up[e, :, i:], hub["thinker.model.layers.1.mlp.experts.3.up_proj.weight"].T
    )
    assert torch.equal(down[e], hub["thinker.model.layers.1.mlp.experts.3.down_proj.weight"].T)


def test_output_shards_index_and_metadata(tiny_omni_dir, tmp_path):
    result = extract(tiny_omni_dir, tmp_path / "vl", variant="vl", shard_size=200_000)
    index = json.loads((result.dst / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == list(result.shards)
    assert len(result.shards) > 1
    total = 0
    for fname in result.shards:
        assert (result.dst / fname).stat().st_size <= 200_000 + 20_000  # header slack
        with safe_open(result.dst / fname, "pt") as f:
            assert f.metadata() == {"format": "pt"}
            for k in f.keys():  # noqa: SIM118 - safe_open is not iterable
                assert index["weight_map"][k] == fname
                t = f.get_tensor(k)
                total += t.numel() * t.element_size()
    assert index["metadata"]["total_size"] == total == result.num_bytes


@pytest.mark.parametrize(("choice", "dtype"), [("bf16", torch.bfloat16), ("fp32", torch.float32)])
def test_dtype_conversion(tiny_omni_dir, tmp_path, choice, dtype, read_checkpoint):
    result = extract(tiny_omni_dir, tmp_path / "o", variant="text", dtype=choice)
    tensors = read_checkpoint(result.dst)
    assert {t.dtype for t in tensors.values()} == {dtype}
    hub = read_checkpoint(tiny_omni_dir)
    assert torch.equal(tensors["lm_head.weight"], hub["thinker.lm_head.weight"].to(dtype))
    cfg = json.loads((result.dst / "config.json").read_text())
    assert cfg["dtype"] == {"bf16": "bfloat16", "fp32": "float32"}[choice]


def test_existing_destination_refused_then_overwritten(tiny_omni_dir, tmp_path):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    with pytest.raises(DestinationExistsError, match=str(dst)):
        extract(tiny_omni_dir, dst, variant="audio")
    assert (dst / "keep.txt").read_text() == "mine"
    # --overwrite replaces only a directory omni-extract wrote (issue 15): not this one
    with pytest.raises(DestinationExistsError, match="not written by omni-extract"):
        extract(tiny_omni_dir, dst, variant="audio", overwrite=True)
    assert (dst / "keep.txt").read_text() == "mine"
    ours = tmp_path / "ours"
    extract(tiny_omni_dir, ours, variant="vl")
    extract(tiny_omni_dir, ours, variant="audio", overwrite=True)
    assert json.loads((ours / "omni_extract.json").read_text())["variant"] == "audio"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "ours"]


def test_refuses_to_overwrite_the_source(tiny_omni_dir):
    with pytest.raises(ExtractError, match="source"):
        extract(tiny_omni_dir, tiny_omni_dir, variant="vl", overwrite=True)
    assert (tiny_omni_dir / "config.json").is_file()


def test_interrupted_extraction_leaves_old_destination_intact(tiny_omni_dir, tmp_path):
    dst = tmp_path / "dst"
    first = extract(tiny_omni_dir, dst, variant="text")
    before = {p.name: p.read_bytes() for p in first.dst.iterdir()}
    calls = []

    def interrupt(nbytes: int, ntensors: int) -> None:
        calls.append(nbytes)
        if len(calls) == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        extract(tiny_omni_dir, dst, variant="vl", overwrite=True, progress=interrupt)
    assert {p.name: p.read_bytes() for p in dst.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"]


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size("300kb") == 300_000
    assert parse_size(123) == 123
    with pytest.raises(ValueError, match="shard size"):
        parse_size("lots")


@given(
    rows=st.integers(1, 40),
    cols=st.integers(1, 40),
    pad=st.integers(0, 9),
    dtypes=st.sampled_from(
        [
            (torch.bfloat16, torch.bfloat16),
            (torch.float32, torch.float32),
            (torch.float16, torch.float16),
            (torch.bfloat16, torch.float32),
            (torch.float32, torch.bfloat16),
        ]
    ),
)
@settings(max_examples=60, deadline=None)
def test_transpose_into_is_bit_exact(rows, cols, pad, dtypes):
    from omni_extract.kernels import transpose_into

    src_dtype, dst_dtype = dtypes
    src = torch.randn(rows, cols).to(src_dtype)
    block = torch.zeros(cols, rows + pad, dtype=dst_dtype)
    transpose_into(block[:, pad:], src)
    assert torch.equal(block[:, pad:], src.T.to(dst_dtype))
    assert not block[:, :pad].any()


def test_progress_reports_every_byte_and_tensor(tiny_omni_dir, tmp_path):
    seen = {"bytes": 0, "tensors": 0, "calls": 0}

    def progress(nbytes: int, ntensors: int) -> None:
        seen["bytes"] += nbytes
        seen["tensors"] += ntensors
        seen["calls"] += 1

    result = extract(tiny_omni_dir, tmp_path / "vl", variant="vl", progress=progress)
    assert seen["bytes"] == result.num_bytes and seen["tensors"] == result.num_tensors
    assert seen["calls"] > result.num_tensors  # fused tensors report per expert
