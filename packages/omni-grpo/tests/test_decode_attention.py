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


_KERNEL_CHECK = """
import torch
from omni_grpo.models.decode_kernel import decode_attention_kernel, num_splits
gen = torch.Generator().manual_seed(0)
worst, splits = 0.0, set()
for rows, length, slot in [(3, 200, 150), (2, 70, 69), (5, 300, 40), (1, 64, 0)]:
    q = torch.randn(rows, 2, 8, 32, generator=gen)
    k = torch.randn(rows, 2, length, 32, generator=gen)
    v = torch.randn(rows, 2, length, 32, generator=gen)
    k[..., slot + 1 :, :] = float("nan")  # never read: past the slot
    v[..., slot + 1 :, :] = float("nan")
    start = torch.randint(0, slot + 1, (rows,), generator=gen).int()
    k[0, :, : start[0]] = float("nan")  # left padding of row 0: never read either
    v[0, :, : start[0]] = float("nan")
    out = decode_attention_kernel(q, k, v, start, torch.tensor([slot]), 0.2)
    pos = torch.arange(length)
    keep = (pos[None] >= start[:, None].long()) & (pos[None] <= slot)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.nan_to_num(), v.nan_to_num(), attn_mask=keep[:, None, None], scale=0.2
    )
    worst = max(worst, float((out - ref).abs().max()))
    splits.add(num_splits(rows, 2, q.device))
print(worst, len(splits))
"""


def test_split_kv_kernel_equals_masked_sdpa_in_the_interpreter() -> None:
    """The decode kernel (Triton's CPU interpreter): each row attends to exactly its keys
    ``[start, slot]`` — NaNs outside would poison the result — with 1 to 16 splits."""
    import os
    import subprocess
    import sys

    import pytest

    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run(
        [sys.executable, "-c", _KERNEL_CHECK], env=env, capture_output=True, text=True, timeout=600
    )
    assert res.returncode == 0, res.stderr[-2000:]
    worst, kinds = res.stdout.split()
    assert float(worst) < 1e-5
    assert int(kinds) >= 2  # several split counts exercised


class _ReleasedWidths(torch.nn.Module):
    """The released thinker's text config (48 layers, 4 KV heads of 128) without its weights."""

    def __init__(self) -> None:
        from types import SimpleNamespace

        super().__init__()
        text = SimpleNamespace(
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            hidden_size=2048,
        )
        self.config = SimpleNamespace(text_config=text)
        self.w = torch.nn.Parameter(torch.zeros(1, dtype=torch.float32))


def test_a_rollout_that_cannot_fit_is_refused_at_start_up(monkeypatch) -> None:
    """The engine is refused when it is built (before any step) from the settings alone."""
    import pytest
    from omni_grpo.config import RolloutConfig
    from omni_grpo.models import generation as gen
    from omni_grpo.rollout.embedded import EmbeddedEngine

    model = _ReleasedWidths()
    per_position = gen.kv_bytes_per_position(model, torch.bfloat16)
    assert per_position == 48 * 2 * 4 * 128 * 2
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (30 << 30, 140 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    static = {"batching": "static"}
    fits = RolloutConfig(
        prompts_per_step=32, n_samples=8, sampling={"max_new_tokens": 512}, embedded=static
    )
    EmbeddedEngine.from_rollout_config(fits, policy=model, device="cuda")  # 12 GiB of 30
    too_big = RolloutConfig(
        prompts_per_step=32, n_samples=8, sampling={"max_new_tokens": 2048}, embedded=static
    )
    with pytest.raises(
        gen.KVCacheTooLarge,
        match=r"256 rows x 2048 new tokens needs at least 48.0 GiB before any prompt token, "
        r"but 30.0 GiB are free",
    ):
        EmbeddedEngine.from_rollout_config(too_big, policy=model, device="cuda")
    # batches above max_batch_rows are generated one after another: only one is resident
    engine = EmbeddedEngine(model, [0], device="cuda", max_batch_rows=64)
    engine.check_fits(32, 8, 2048)  # 64 rows x 2048: 12 GiB
    # on the CPU nothing is checked (host memory is not the decode's limit)
    EmbeddedEngine.from_rollout_config(too_big, policy=model, device="cpu")
    # continuous batching (the default on CUDA): the slots follow the free memory, so only one
    # row of prompt + max_new_tokens has to fit
    continuous = too_big.model_copy(
        update={"embedded": too_big.embedded.model_copy(update={"batching": "auto"})}
    )
    EmbeddedEngine.from_rollout_config(continuous, policy=model, device="cuda")
    one_row = too_big.model_copy(
        update={"sampling": too_big.sampling.model_copy(update={"max_new_tokens": 400_000})}
    )
    with pytest.raises(gen.KVCacheTooLarge, match=r"1 rows x 400000 new tokens"):
        EmbeddedEngine.from_rollout_config(
            one_row.model_copy(update={"embedded": continuous.embedded}),
            policy=model,
            device="cuda",
        )
