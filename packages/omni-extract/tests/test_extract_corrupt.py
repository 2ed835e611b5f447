"""Bad input fails loud, names the key or file, and leaves nothing behind."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from omni_extract import extract
from omni_extract.errors import (
    EmptySelectionError,
    MissingExpertError,
    MissingShardError,
    NotQwen3OmniError,
    TensorMismatchError,
    UnmappedTensorError,
)


def _assert_nothing_written(dst):
    assert not dst.exists()
    assert not [p for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}")]


def _fails(src, tmp_path, exc, match, variant="vl"):
    dst = tmp_path / "out" / "dst"
    dst.parent.mkdir(exist_ok=True)
    with pytest.raises(exc, match=match):
        extract(src, dst, variant=variant)
    _assert_nothing_written(dst)


def test_missing_shard_listed_in_index(tiny_omni_dir, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(tiny_omni_dir, src)
    (src / "model-00002-of-00003.safetensors").unlink()
    _fails(src, tmp_path, MissingShardError, r"model-00002-of-00003\.safetensors")


def test_index_lists_tensor_its_shard_lacks(rewrite, tmp_path):
    src = rewrite()
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"]["thinker.model.layers.0.extra.weight"] = "model-00001-of-00003.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    _fails(src, tmp_path, MissingShardError, r"thinker\.model\.layers\.0\.extra\.weight")


@pytest.mark.parametrize("variant", ["text", "vl", "audio"])
def test_zero_tensors_selected(rewrite, tmp_path, variant):
    src = rewrite(edit=lambda t: {k: v for k, v in t.items() if not k.startswith("thinker.")})
    _fails(
        src, tmp_path, EmptySelectionError, f"variant '{variant}' selected zero tensors", variant
    )


def test_unexpected_shape(rewrite, tmp_path):
    name = "thinker.model.layers.1.self_attn.q_proj.weight"
    src = rewrite(edit=lambda t: {**t, name: t[name][:-1]})
    _fails(
        src,
        tmp_path,
        TensorMismatchError,
        rf"{name}'? has shape \[\d+, \d+\], config\.json implies",
    )


def test_unexpected_expert_shape_transposed(rewrite, tmp_path):
    name = "thinker.model.layers.0.mlp.experts.1.down_proj.weight"
    src = rewrite(edit=lambda t: {**t, name: t[name].T.contiguous()})
    _fails(src, tmp_path, TensorMismatchError, name.replace(".", r"\."))


def test_unexpected_dtype(rewrite, tmp_path):
    name = "thinker.model.norm.weight"
    src = rewrite(edit=lambda t: {**t, name: t[name].to(torch.int32)})
    _fails(src, tmp_path, TensorMismatchError, rf"{name}'? has dtype I32")


def test_expert_missing_from_a_layer(rewrite, tmp_path):
    name = "thinker.model.layers.1.mlp.experts.2.up_proj.weight"
    src = rewrite(edit=lambda t: {k: v for k, v in t.items() if k != name})
    _fails(src, tmp_path, MissingExpertError, "layer 1 lacks expert 2 up_proj")


def test_unmapped_thinker_tensor(rewrite, tmp_path):
    name = "thinker.model.layers.0.mlp.shared_expert.gate_proj.weight"
    src = rewrite(edit=lambda t: {**t, name: torch.zeros(16, 64)})
    _fails(src, tmp_path, UnmappedTensorError, name.replace(".", r"\."))


def test_tensor_beyond_the_config(rewrite, tmp_path):
    name = "thinker.model.layers.7.input_layernorm.weight"  # the config has 2 layers
    src = rewrite(edit=lambda t: {**t, name: torch.ones(64)})
    _fails(src, tmp_path, TensorMismatchError, name.replace(".", r"\."))


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (
            lambda c: {**c, "model_type": "qwen3_vl_moe"},
            "model_type is 'qwen3_vl_moe', expected 'qwen3_omni_moe'",
        ),
        (lambda c: {k: v for k, v in c.items() if k != "thinker_config"}, "thinker_config"),
        (
            lambda c: {**c, "thinker_config": {**c["thinker_config"], "audio_config": None}},
            "thinker_config.audio_config",
        ),
    ],
)
def test_config_not_qwen3_omni(tiny_omni_dir, tmp_path, edit, match):
    src = tmp_path / "src"
    shutil.copytree(tiny_omni_dir, src)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(edit(cfg)))
    _fails(src, tmp_path, NotQwen3OmniError, match)


def test_missing_config(tiny_omni_dir, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(tiny_omni_dir, src)
    (src / "config.json").unlink()
    _fails(src, tmp_path, NotQwen3OmniError, "no config.json")


def test_missing_sideband_field(tiny_omni_dir, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(tiny_omni_dir, src)
    cfg = json.loads((src / "config.json").read_text())
    del cfg["thinker_config"]["position_id_per_seconds"]
    (src / "config.json").write_text(json.dumps(cfg))
    _fails(src, tmp_path, NotQwen3OmniError, "thinker_config.position_id_per_seconds")


def test_no_tokenizer_files(tiny_omni_dir, tmp_path):
    from omni_extract.errors import ExtractError

    src = tmp_path / "src"
    shutil.copytree(tiny_omni_dir, src)
    (src / "tokenizer.json").unlink()
    _fails(src, tmp_path, ExtractError, "no tokenizer files")


def test_truncated_shard(tiny_omni_dir, tmp_path):
    from omni_extract.errors import CorruptShardError

    src = tmp_path / "src"
    shutil.copytree(tiny_omni_dir, src)
    shard = src / "model-00003-of-00003.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    _fails(src, tmp_path, CorruptShardError, r"model-00003-of-00003\.safetensors")


def test_garbled_header_length_names_the_shard(tiny_omni_dir, tmp_path):
    """A header length past the end of the file is a corrupt shard, not a MemoryError."""
    from omni_extract.errors import CorruptShardError

    src = tmp_path / "src"
    shutil.copytree(tiny_omni_dir, src)
    shard = src / "model-00001-of-00003.safetensors"
    data = bytearray(shard.read_bytes())
    data[:8] = (1 << 40).to_bytes(8, "little")
    shard.write_bytes(bytes(data))
    _fails(src, tmp_path, CorruptShardError, r"00001-of-00003\.safetensors.*exceeds the file size")


def test_cli_prints_a_multi_line_reason_on_one_line(tiny_omni_dir, tmp_path):
    """transformers' config validation answers over two lines; the CLI still prints one."""
    from click.testing import CliRunner
    from omni_extract.cli import extract_command

    src = tmp_path / "src"
    shutil.copytree(tiny_omni_dir, src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["thinker_config"]["audio_token_id"] = "x"
    (src / "config.json").write_text(json.dumps(cfg))
    res = CliRunner().invoke(
        extract_command, ["--src", str(src), "--dst", str(tmp_path / "o"), "--variant", "vl"]
    )
    assert res.exit_code == 1
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "audio_token_id" in lines[0], res.output


def test_expected_names_accept_the_flat_thinker_layout_of_older_transformers():
    """transformers 5.17 names the thinker's parts ``audio_tower.*``/``visual.*``/``model.*``."""
    from omni_extract.names import match_in_memory as _match_in_memory

    nested = _match_in_memory("model.audio_tower.layers.0.fc1.weight")
    flat = _match_in_memory("audio_tower.layers.0.fc1.weight")
    assert flat is not None and nested is not None
    assert flat.name_in("hub") == nested.name_in("hub") == "thinker.audio_tower.layers.0.fc1.weight"
    text = _match_in_memory("model.layers.1.self_attn.q_proj.weight")
    assert text is not None
    assert text.name_in("hub") == "thinker.model.layers.1.self_attn.q_proj.weight"
    assert _match_in_memory("visual.blocks.0.attn.qkv.weight").name_in("hub") == (
        "thinker.visual.blocks.0.attn.qkv.weight"
    )


def test_weight_sync_names_accept_the_flat_thinker_layout_of_older_transformers():
    import torch
    from omni_extract.names import to_server_name, to_server_tensors

    assert (
        to_server_name("model.layers.0.mlp.gate.weight") == "thinker.model.layers.0.mlp.gate.weight"
    )
    flat = [
        ("visual.merger_list.0.ln_q.weight", torch.zeros(4)),
        ("audio_tower.conv_out.weight", torch.zeros(2, 2)),
        ("model.layers.0.mlp.experts.gate_up_proj", torch.zeros(4, 32, 64)),
        ("lm_head.weight", torch.zeros(3, 64)),
    ]
    out = dict(to_server_tensors(flat, layout="hf_memory", towers="skip"))
    assert set(out) == {"thinker.lm_head.weight", "thinker.model.layers.0.mlp.experts.gate_up_proj"}
    assert out["thinker.model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 32)
