"""One-token GQA decode attention (issue 27): equals transformers' SDPA path, and decode uses it."""

from __future__ import annotations

import torch
from omni_grpo.models import decode_attention as da
from transformers.integrations.sdpa_attention import repeat_kv


class _Attn(torch.nn.Module):
    num_key_value_groups = 4
    is_causal = True


def test_packed_gqa_equals_repeated_kv_sdpa() -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 8, 1, 16, generator=gen)
    k = torch.randn(3, 2, 11, 16, generator=gen)
    v = torch.randn(3, 2, 11, 16, generator=gen)
    mask = torch.ones(3, 1, 1, 11, dtype=torch.bool)
    mask[0, ..., :4] = False  # left padding of row 0
    out, _ = da.gqa_decode_attention(_Attn(), q, k, v, mask, scaling=0.25)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, repeat_kv(k, 4), repeat_kv(v, 4), attn_mask=mask, scale=0.25
    )
    assert out.shape == (3, 1, 8, 16)
    assert torch.allclose(out, ref.transpose(1, 2), atol=1e-6)


def test_decode_steps_attend_through_it_and_restore(monkeypatch, tmp_path) -> None:
    from omni_grpo.models.generation import generate
    from omni_grpo.testing.rollouts import rollout_world

    world = rollout_world(tmp_path, max_new_tokens=3)
    model = world["base"]
    calls: list[int] = []
    real = da.gqa_decode_attention

    def counting(*args, **kwargs):
        calls.append(args[1].shape[2])
        return real(*args, **kwargs)

    monkeypatch.setattr(da, "gqa_decode_attention", counting)
    monkeypatch.setattr(da, "_REGISTERED", False)  # re-register the counting function
    before = model.model.language_model.layers[0].self_attn.config._attn_implementation
    c = world["groups"][0][0]
    ids = torch.tensor([c.prompt.input_ids])
    out = generate(model, ids, max_new_tokens=4, repeats=3, **c.prompt.mm)
    assert out.tokens.shape == (3, 4)
    layers = len(model.model.language_model.layers)
    assert calls == [1] * (3 * layers)  # every decode step of every layer, one query row each
    assert model.model.language_model.layers[0].self_attn.config._attn_implementation == before
    monkeypatch.setattr(da, "_REGISTERED", False)


def test_kv_cache_that_cannot_fit_is_refused_with_its_size(monkeypatch) -> None:
    import pytest
    from omni_grpo.models import generation as gen

    layer_kv = [(torch.zeros(1, 4, 3, 128, dtype=torch.bfloat16),) * 2] * 48
    need = gen.kv_cache_bytes(layer_kv, rows=256, tokens=1024)
    assert need == 48 * 2 * 256 * 4 * 1024 * 128 * 2  # 24 GiB
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 << 30, 140 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 6 << 30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 4 << 30)
    cuda = torch.device("cuda")
    with pytest.raises(
        gen.KVCacheTooLarge, match=r"256 rows x 1024 tokens needs 24.0 GiB but 12.0"
    ):
        gen.check_kv_fits(layer_kv, 256, 1024, cuda)
    gen.check_kv_fits(layer_kv, 64, 1024, cuda)  # 6 GiB: fits
