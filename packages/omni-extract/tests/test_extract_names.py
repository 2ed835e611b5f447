"""The name table round-trips every tensor, and weight sync hands sglang-omni what it loads."""

from __future__ import annotations

import json
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from omni_extract import extract, is_server_syncable, to_server_name, to_server_tensors
from omni_extract.errors import FrozenTensorError, UnmappedTensorError
from omni_extract.names import NAME_TABLE, match, match_hub
from safetensors import safe_open


def _read_all(ckpt):
    index = ckpt / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.exists()
        else ["model.safetensors"]
    )
    out = {}
    for fname in files:
        with safe_open(ckpt / fname, "pt") as f:
            for k in f.keys():  # noqa: SIM118 - safe_open is not iterable
                out[k] = f.get_tensor(k)
    return out


@pytest.fixture(scope="module")
def hub(tiny_omni_dir):
    return _read_all(tiny_omni_dir)


@pytest.fixture(scope="module")
def vl_dir(tiny_omni_dir, tmp_path_factory):
    return extract(
        tiny_omni_dir, tmp_path_factory.mktemp("vl") / "vl", variant="vl", shard_size="300KB"
    ).dst


@pytest.fixture(scope="module")
def text_dir(tiny_omni_dir, tmp_path_factory):
    return extract(tiny_omni_dir, tmp_path_factory.mktemp("text") / "text", variant="text").dst


# What sglang-omni's Qwen3OmniThinkerForCausalLM.load_weights does with a name (contract §4.5),
# written from the contract text, independent of our table.
_SERVER_SKIP = ("talker.", "code2wav.", "audio_tower.", "visual.")
_QWEN3_MOE_PARAM = re.compile(
    r"(model\.embed_tokens\.weight|model\.norm\.weight|lm_head\.weight|"
    r"model\.layers\.\d+\.(input_layernorm|post_attention_layernorm)\.weight|"
    r"model\.layers\.\d+\.self_attn\.([qkvo]_proj|[qk]_norm)\.weight|"
    r"model\.layers\.\d+\.mlp\.gate\.weight|"
    r"model\.layers\.\d+\.mlp\.experts\.(\d+\.(gate|up|down)_proj\.weight|gate_up_proj|down_proj))"
)


def _server_accepts(name: str) -> bool:
    name = name.replace("model.language_model.", "model.").removeprefix("thinker.")
    if name.startswith(_SERVER_SKIP):
        return False
    return bool(_QWEN3_MOE_PARAM.fullmatch(name))


def _server_load(sent: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Unfold what the server received back to hub per-expert tensors (it transposes fused ones)."""
    out = {}
    for name, t in sent.items():
        m = re.fullmatch(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)", name)
        if not m:
            out[name] = t
            continue
        mem = t.transpose(1, 2)  # the unconditional transpose of the thinker stage
        for e in range(mem.shape[0]):
            if m.group(2) == "down_proj":
                out[f"{m.group(1)}.{e}.down_proj.weight"] = mem[e]
            else:
                half = mem.shape[1] // 2
                out[f"{m.group(1)}.{e}.gate_proj.weight"] = mem[e, :half]
                out[f"{m.group(1)}.{e}.up_proj.weight"] = mem[e, half:]
    return out


def _lm_hub(hub):
    return {k: v for k, v in hub.items() if k.startswith(("thinker.model.", "thinker.lm_head."))}


@pytest.mark.parametrize("variant_dir", ["vl_dir", "text_dir"])
def test_every_output_tensor_round_trips_to_the_hub(variant_dir, request, hub):
    ckpt = request.getfixturevalue(variant_dir)
    tensors = _read_all(ckpt)
    sent = dict(to_server_tensors(tensors.items(), layout="vl_hub", towers="skip"))
    assert all(_server_accepts(n) for n in sent), [n for n in sent if not _server_accepts(n)]
    rebuilt = _server_load(sent)
    want = _lm_hub(hub)
    assert rebuilt.keys() == want.keys()
    for name, t in want.items():
        assert torch.equal(rebuilt[name], t), name
    skipped = [n for n in tensors if not is_server_syncable(n)]
    assert all(n.startswith("model.visual.") for n in skipped)


def test_hf_memory_layout_is_transposed_back(vl_dir):
    from transformers import Qwen3VLMoeForConditionalGeneration

    model = Qwen3VLMoeForConditionalGeneration.from_pretrained(vl_dir, dtype=torch.float32)
    files = _read_all(vl_dir)
    mem = model.state_dict()
    fused = [k for k in mem if k.endswith("experts.gate_up_proj")]
    assert fused and mem[fused[0]].shape != files[fused[0]].shape  # non-square: layouts differ
    from_mem = dict(to_server_tensors(mem.items(), layout="hf_memory", towers="skip"))
    from_files = dict(to_server_tensors(files.items(), layout="vl_hub", towers="skip"))
    assert from_mem.keys() == from_files.keys()
    for name in from_files:
        assert torch.equal(from_mem[name], from_files[name]), name


def test_omni_thinker_in_memory_names_sync_too(tiny_omni_dir, hub):
    from transformers import Qwen3OmniMoeThinkerForConditionalGeneration

    thinker = Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(
        tiny_omni_dir, dtype=torch.float32
    )
    sent = dict(to_server_tensors(thinker.state_dict().items(), layout="hf_memory", towers="skip"))
    rebuilt = _server_load(sent)
    want = _lm_hub(hub)
    assert rebuilt.keys() == want.keys()
    assert all(torch.equal(rebuilt[k], want[k]) for k in want)


def test_towers_refused_unless_skipped():
    t = torch.zeros(2, 2)
    for name in (
        "model.visual.blocks.0.attn.qkv.weight",
        "model.visual.merger.norm.weight",
        "model.audio_tower.conv2d1.weight",
        "audio_tower.proj1.weight",
    ):
        assert not is_server_syncable(name)
        with pytest.raises(FrozenTensorError, match="frozen"):
            list(to_server_tensors([(name, t)], layout="vl_hub"))
        assert list(to_server_tensors([(name, t)], layout="vl_hub", towers="skip")) == []


@pytest.mark.parametrize(
    "name",
    [
        "body.model.layers.0.mlp.gate.weight",
        "model.layers.0.mlp.experts.gate_up",
        "language_model.norm.weight",
        "talker.model.norm.weight",
    ],
)
def test_unknown_names_are_errors_not_silent_drops(name):
    with pytest.raises(UnmappedTensorError):
        to_server_name(name)
    with pytest.raises(UnmappedTensorError):
        list(to_server_tensors([(name, torch.zeros(1))], layout="vl_hub", towers="skip"))


def test_layout_must_be_explicit():
    with pytest.raises(ValueError, match="layout"):
        list(to_server_tensors([], layout="auto"))  # type: ignore[arg-type]


def test_fused_tensor_must_be_3d():
    with pytest.raises(ValueError, match="3-D"):
        list(
            to_server_tensors(
                [("model.language_model.layers.0.mlp.experts.down_proj", torch.zeros(4, 4))],
                layout="hf_memory",
            )
        )


def test_unmapped_hub_name_is_an_error():
    with pytest.raises(UnmappedTensorError, match="thinker.foo"):
        match_hub("thinker.foo.weight")


@given(
    layer=st.integers(0, 200),
    expert=st.integers(0, 511),
    proj=st.sampled_from(["gate", "up", "down"]),
)
def test_expert_names_round_trip(layer, expert, proj):
    hub = f"thinker.model.layers.{layer}.mlp.experts.{expert}.{proj}_proj.weight"
    found = match_hub(hub)
    text = found.name_in("text")
    assert text == f"model.layers.{layer}.mlp.experts.{expert}.{proj}_proj.weight"
    assert to_server_name(text) == hub
    fused = "gate_up_proj" if proj != "down" else "down_proj"
    vl = f"model.language_model.layers.{layer}.mlp.experts.{fused}"
    assert to_server_name(vl) == f"thinker.model.layers.{layer}.mlp.experts.{fused}"
    assert to_server_name(f"model.layers.{layer}.mlp.experts.{fused}") == to_server_name(vl)


@given(
    layer=st.integers(0, 200),
    part=st.sampled_from(
        [
            "input_layernorm.weight",
            "self_attn.q_proj.weight",
            "self_attn.k_norm.weight",
            "mlp.gate.weight",
        ]
    ),
)
def test_lm_names_round_trip_through_every_layout(layer, part):
    hub = f"thinker.model.layers.{layer}.{part}"
    found = match_hub(hub)
    for layout in ("vl", "text", "hf_omni"):
        name = found.name_in(layout)
        assert name is not None
        back = match(name, layout)
        assert back is not None and back.name_in("hub") == hub
        assert to_server_name(name) == hub


def test_table_templates_are_unambiguous_per_layout():
    """No name in any layout is claimed by two rows (first-match order is then irrelevant)."""
    samples = {
        "layer": "3",
        "expert": "7",
        "i": "1",
        "p": "weight",
        "lm": "layers.3.self_attn.q_proj.weight",
        "vis": "blocks.0.attn.qkv.weight",
        "rest": "layers.0.fc1.weight",
        "other": "talker.x",
    }
    for layout in ("hub", "hf_omni", "vl", "text", "audio", "server"):
        for row in NAME_TABLE:
            template = getattr(row, layout)
            if template is None:
                continue
            name = template.format(**samples)
            assert match(name, layout).row is row, (layout, name)
