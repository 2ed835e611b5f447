"""``omni_extract.export``: trained pseudo-VL tensors written back over a hub checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omni_extract import extract
from omni_extract.errors import DestinationExistsError, NotAnExportError, TensorMismatchError
from omni_extract.export import MARKER_FILE, export_trained
from omni_extract.trained import NoTrained, SafetensorsTrained
from safetensors.torch import save_file


@pytest.fixture(scope="module")
def vl_dir(tiny_omni_dir, tmp_path_factory) -> Path:
    return extract(tiny_omni_dir, tmp_path_factory.mktemp("x") / "vl", variant="vl").dst


def _vl_files(d: Path) -> list[Path]:
    return sorted(d.glob("*.safetensors"))


def test_extracted_weights_written_back_reproduce_the_base(
    tiny_omni_dir, vl_dir, tmp_path, read_checkpoint
):
    """vl -> omni is the inverse of omni -> vl: every tensor, every shard file, the index."""
    result = export_trained(
        tiny_omni_dir, tmp_path / "o", SafetensorsTrained(_vl_files(vl_dir), "vl_hub")
    )
    base, out = read_checkpoint(tiny_omni_dir), read_checkpoint(tmp_path / "o")
    assert base.keys() == out.keys() and all(torch.equal(base[k], out[k]) for k in base)
    assert result.shards == tuple(sorted(p.name for p in tiny_omni_dir.glob("*.safetensors")))
    assert json.loads((tmp_path / "o" / MARKER_FILE).read_text())["format"] == "omni"
    # and into the VL layout: what extraction wrote
    export_trained(
        tiny_omni_dir, tmp_path / "v", SafetensorsTrained(_vl_files(vl_dir), "vl_hub"), fmt="vl"
    )
    a, b = read_checkpoint(vl_dir), read_checkpoint(tmp_path / "v")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_in_memory_fused_layout_maps_to_per_expert_matrices(
    tiny_omni_dir, vl_dir, tmp_path, read_checkpoint
):
    """transformers' [E, 2I, H] / [E, H, I]: gate rows, then up rows; each expert lands on its hub name."""
    vl = read_checkpoint(vl_dir)
    layer = "model.language_model.layers.1.mlp.experts."
    gate_up = torch.randn(vl[layer + "gate_up_proj"].transpose(1, 2).shape)
    down = torch.randn(vl[layer + "down_proj"].transpose(1, 2).shape)
    save_file(
        {layer + "gate_up_proj": gate_up, layer + "down_proj": down},
        str(tmp_path / "t.safetensors"),
    )
    trained = SafetensorsTrained([tmp_path / "t.safetensors"], "hf_memory")
    export_trained(tiny_omni_dir, tmp_path / "o", trained)
    out, base = read_checkpoint(tmp_path / "o"), read_checkpoint(tiny_omni_dir)
    i = gate_up.shape[1] // 2
    hub = "thinker.model.layers.1.mlp.experts."
    for e in range(gate_up.shape[0]):
        assert torch.equal(out[f"{hub}{e}.gate_proj.weight"], gate_up[e, :i])
        assert torch.equal(out[f"{hub}{e}.up_proj.weight"], gate_up[e, i:])
        assert torch.equal(out[f"{hub}{e}.down_proj.weight"], down[e])
    untouched = [k for k in base if ".layers.1.mlp.experts." not in k]
    assert all(torch.equal(base[k], out[k]) for k in untouched)


def test_mismatches_are_refused_before_writing(tiny_omni_dir, vl_dir, tmp_path):
    name = "model.language_model.layers.0.self_attn.q_proj.weight"
    save_file({name: torch.zeros(3, 3)}, str(tmp_path / "bad.safetensors"))
    with pytest.raises(TensorMismatchError, match=r"q_proj.weight.*shape \[3, 3\]"):
        export_trained(
            tiny_omni_dir,
            tmp_path / "o",
            SafetensorsTrained([tmp_path / "bad.safetensors"], "hf_memory"),
        )
    save_file(
        {"model.language_model.layers.9.self_attn.q_proj.weight": torch.zeros(3)},
        str(tmp_path / "l.safetensors"),
    )
    with pytest.raises(TensorMismatchError, match="layers.9"):
        export_trained(
            tiny_omni_dir,
            tmp_path / "o",
            SafetensorsTrained([tmp_path / "l.safetensors"], "hf_memory"),
        )
    save_file({"encoder.weight": torch.zeros(3)}, str(tmp_path / "u.safetensors"))
    with pytest.raises(TensorMismatchError, match="encoder.weight"):
        export_trained(
            tiny_omni_dir,
            tmp_path / "o",
            SafetensorsTrained([tmp_path / "u.safetensors"], "hf_memory"),
        )
    assert not (tmp_path / "o").exists()


def test_destination_rules(tiny_omni_dir, tmp_path):
    export_trained(tiny_omni_dir, tmp_path / "o", NoTrained())
    with pytest.raises(DestinationExistsError, match="--overwrite"):
        export_trained(tiny_omni_dir, tmp_path / "o", NoTrained())
    export_trained(tiny_omni_dir, tmp_path / "o", NoTrained(), overwrite=True)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "data.bin").write_bytes(b"x")
    with pytest.raises(NotAnExportError, match=MARKER_FILE):
        export_trained(tiny_omni_dir, mine, NoTrained(), overwrite=True)
    assert (mine / "data.bin").read_bytes() == b"x"
