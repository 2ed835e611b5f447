"""The HF pseudo-VL <-> Megatron name table and packings: sharded load + gathered export round-trip."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from omni_grpo.backends.megatron import UnmappedTensorError, megatron_model_args
from omni_grpo.backends.megatron.export import expected_hf_names
from omni_grpo.backends.megatron.model import SafetensorsDir
from omni_grpo.backends.megatron.names import (
    NAME_TABLE,
    ShardSpec,
    fuse_expert_rows,
    hf_tensors_from_megatron,
    match_megatron,
    megatron_tensor_from_hf,
    pack_qkv,
    unpack_qkv,
)
from omni_grpo.config import MegatronConfig


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from omni_extract import extract
    from omni_extract.tiny import TinyOmniSpec, make_tiny_omni

    root = tmp_path_factory.mktemp("names")
    make_tiny_omni(root / "omni", TinyOmniSpec())
    extract(root / "omni", root / "vl", variant="vl")
    return root / "vl"


def megatron_names(layers: int, local_experts: int, impl: str) -> list[str]:
    """The parameter names GPTModel + our local spec produce (the order does not matter here)."""
    skip = {"fc1_expert", "fc2_expert"} if impl == "grouped" else {"fc1_grouped", "fc2_grouped"}
    out = []
    for rule in NAME_TABLE:
        if rule.kind in skip:
            continue
        for layer in range(layers) if "{L}" in rule.megatron else [None]:
            for e in range(local_experts) if "{E}" in rule.megatron else [None]:
                out.append(rule.megatron.replace("{L}", str(layer)).replace("{E}", str(e)))
    return out


@settings(max_examples=30, deadline=None)
@given(
    groups=st.integers(1, 4), per=st.integers(1, 4), d=st.integers(1, 8), hidden=st.integers(1, 16)
)
def test_qkv_pack_round_trip(groups: int, per: int, d: int, hidden: int) -> None:
    q = torch.randn(groups * per * d, hidden)
    k, v = torch.randn(groups * d, hidden), torch.randn(groups * d, hidden)
    packed = pack_qkv(q, k, v, groups)
    # layout: group g = its `per` query heads, then k_g, then v_g
    g_rows = (per + 2) * d
    for g in range(groups):
        block = packed[g * g_rows : (g + 1) * g_rows]
        assert torch.equal(block[: per * d], q[g * per * d : (g + 1) * per * d])
        assert torch.equal(block[per * d : (per + 1) * d], k[g * d : (g + 1) * d])
        assert torch.equal(block[(per + 1) * d :], v[g * d : (g + 1) * d])
    q2, k2, v2 = unpack_qkv(packed, groups * per, groups, d)
    assert torch.equal(q2, q) and torch.equal(k2, k) and torch.equal(v2, v)


def test_unknown_megatron_name_raises() -> None:
    with pytest.raises(UnmappedTensorError, match="decoder.layers.0.mlp.shared_experts"):
        match_megatron("decoder.layers.0.mlp.shared_experts.linear_fc1.weight")


@pytest.mark.parametrize("impl", ["grouped", "sequential"])
@pytest.mark.parametrize(("tp", "ep"), [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_sharded_load_then_gathered_export_is_bit_exact(
    vl_dir: Path, impl: str, tp: int, ep: int
) -> None:
    """Shard every tensor as TP/EP ranks would load it, gather as export does, compare with the file."""
    cfg = json.loads((vl_dir / "config.json").read_text())
    args = megatron_model_args(cfg, MegatronConfig(tp=tp, ep=ep, sp=tp > 1), experts_impl=impl)
    t = args.transformer
    src = SafetensorsDir(vl_dir)
    n_exp, per = t["num_moe_experts"], t["num_moe_experts"] // ep
    dims = dict(num_heads=t["num_attention_heads"], num_query_groups=t["num_query_groups"])
    exported: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for name in megatron_names(t["num_layers"], per, impl):
        rule, layer, local_e = match_megatron(name)
        shards = {
            (tr, er): megatron_tensor_from_hf(
                name, src.get, num_experts=n_exp, shard=ShardSpec(tr, tp, er, ep), **dims
            )
            for tr in range(tp)
            for er in range(ep)
        }
        # TP gather (along tp_dim) of EP rank 0's shards; replicated tensors are identical everywhere
        if rule.tp_dim is None:
            assert all(
                torch.equal(s, shards[(0, 0)])
                for (_, er), s in shards.items()
                if not rule.ep or er == 0
            )
            full = shards[(0, 0)]
        else:
            full = torch.cat([shards[(tr, 0)] for tr in range(tp)], dim=rule.tp_dim)
        if rule.kind in ("fc1_grouped", "fc2_grouped"):
            full = torch.cat([shards[(0, er)] for er in range(ep)], dim=0)
        if rule.kind in ("fc1_expert", "fc2_expert"):
            for er in range(ep):
                experts.setdefault((layer, rule.kind), {})[er * per + local_e] = shards[(0, er)]
            continue
        for hf_name, tensor in hf_tensors_from_megatron(
            name, full, head_dim=t["kv_channels"], **dims
        ):
            exported[hf_name] = tensor
    for (layer, kind), rows in experts.items():
        hf_name = next(r for r in NAME_TABLE if r.kind == kind).hf[0].replace("{L}", str(layer))
        exported[hf_name] = fuse_expert_rows(rows, kind, n_exp)
    lm = {k for k in src if k.startswith(("model.language_model.", "lm_head."))}
    assert set(exported) == lm == expected_hf_names(args)
    for k in lm:
        assert torch.equal(exported[k], src.get(k)), k


def test_fused_expert_layout_is_checked(vl_dir: Path) -> None:
    from omni_grpo.backends.megatron.names import hf_shapes_check

    src = SafetensorsDir(vl_dir)
    name = "model.language_model.layers.0.mlp.experts.gate_up_proj"
    t = src.get(name)
    cfg = json.loads((vl_dir / "config.json").read_text())["text_config"]
    hf_shapes_check(name, t, cfg["hidden_size"], cfg["moe_intermediate_size"])
    with pytest.raises(ValueError, match="hub VL layout"):
        hf_shapes_check(name, t.transpose(1, 2), cfg["hidden_size"], cfg["moe_intermediate_size"])


def test_missing_expert_rows_raise() -> None:
    with pytest.raises(UnmappedTensorError, match="missing"):
        fuse_expert_rows({0: torch.zeros(4, 2)}, "fc1_expert", 2)
