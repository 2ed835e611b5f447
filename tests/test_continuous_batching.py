"""Continuous batching (``models.continuous``): refill and re-pack bookkeeping on the CPU.

A row's tokens must not depend on which rows share its batch or when it started: the draws are
keyed on the row, so the same seed gives the same completion whether the row finishes first or
last, and whatever the number of slots. Its logprobs must stay the teacher-forced ones.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omni_extract import extract
from omni_grpo.models import load_thinker
from omni_grpo.models.continuous import Prefilled, plan_slots, sample_noise
from omni_grpo.models.generation import (
    ContextTooLong,
    KVCacheTooLarge,
    generate,
    to_left_padding,
)
from omni_grpo.testing.models import Ids, build_batch

TOL = 1e-5
TXT = [5, 6, 7]
SAMPLES = [
    [("text", TXT), ("image", (1, 4, 4)), ("audio", 150), ("text", TXT)],
    [("text", TXT[:1]), ("audio", 101), ("text", TXT)],
    [("text", TXT), ("video", (2, 4, 4), 1.0), ("text", [9])],
]


@pytest.fixture(scope="module")
def thinker(tiny_omni_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("thinker-cont")
    extract(tiny_omni_dir, root / "vl", variant="vl")
    extract(tiny_omni_dir, root / "audio", variant="audio")
    return load_thinker(root / "vl", dtype="float32")


@pytest.fixture(scope="module")
def batch(thinker):
    gen = json.loads((Path(thinker.source_dir) / "generation_config.json").read_text())
    ids = Ids.from_sideband(thinker.sideband.raw, pad=gen["pad_token_id"])
    return build_batch(SAMPLES, ids, "left", seed=3)


def _generate(thinker, batch, limits, **kw):
    media = dict(batch)
    ids, mask = media.pop("input_ids"), media.pop("attention_mask")
    torch.manual_seed(11)
    args = {"max_new_tokens": 40, "temperature": 0.9, "repeats": 2, "row_limits": limits}
    return generate(thinker, ids, mask, batching="continuous", **args, **kw, **media)


def _rows(result):
    return [
        (result.tokens[i, :n].tolist(), result.logprobs[i, :n], result.finish_reasons[i])
        for i, n in enumerate(result.lengths.tolist())
    ]


def test_row_is_the_same_whether_it_finishes_first_or_last(thinker, batch):
    """Row 3 keeps its limit (30); the others end after it in one call and before it in the
    other, through 2 slots (refill), one slot per row (re-packed to 1 once 5 rows ended: a
    check every 16 steps) or one slot."""
    first = torch.tensor([30, 40, 40, 30, 40, 40])
    last = torch.tensor([2, 3, 2, 30, 3, 2])
    runs = [
        _generate(thinker, batch, first, max_slots=2),
        _generate(thinker, batch, last, max_slots=2),
        _generate(thinker, batch, last, max_slots=6),
        _generate(thinker, batch, first, max_slots=1),
    ]
    ref_tokens, ref_lp, _ = _rows(runs[0])[3]
    assert len(ref_tokens) == 30
    for run in runs[1:]:
        tokens, lp, reason = _rows(run)[3]
        assert tokens == ref_tokens and reason == "length"
        assert (lp - ref_lp).abs().max() <= TOL
    # rows with the same limit in two calls agree too (row 0: 30 in both of the `first` calls)
    assert _rows(runs[0])[0][0] == _rows(runs[3])[0][0]
    for run, limits in zip(runs, [first, last, last, first], strict=True):
        assert run.lengths.tolist() == limits.tolist()


def test_continuous_logprobs_match_teacher_forced(thinker, batch):
    """One sample per prompt, 2 slots for 3 rows: the third row starts in a refilled slot."""
    media = dict(batch)
    ids, mask = media.pop("input_ids"), media.pop("attention_mask")
    limits = torch.tensor([3, 12, 9])
    torch.manual_seed(5)
    result = generate(
        thinker,
        ids,
        mask,
        max_new_tokens=12,
        temperature=0.9,
        row_limits=limits,
        batching="continuous",
        max_slots=2,
        **media,
    )
    ids, mask = to_left_padding(ids, mask)
    n = result.tokens.shape[1]
    valid = torch.arange(n)[None] < result.lengths[:, None]
    full = torch.cat([ids, result.tokens], 1)
    with torch.no_grad():
        logits = thinker(
            input_ids=full, attention_mask=torch.cat([mask, valid.long()], 1), **media
        ).logits
    scaled = logits[:, ids.shape[1] - 1 : ids.shape[1] - 1 + n].float() / 0.9
    lp = torch.log_softmax(scaled, -1).gather(-1, result.tokens[..., None])[..., 0]
    assert (lp - result.logprobs)[valid].abs().max() <= TOL
    assert (result.logprobs[~valid] == 0).all()
    assert result.lengths.tolist() == limits.tolist()


def test_repack_keeps_every_row(thinker, batch, monkeypatch):
    """6 slots re-packed to 2 then 1 as rows end: the same rows as through 1 slot throughout."""
    import omni_grpo.models.continuous as cont

    packs = []
    real = cont.ContinuousDecoder.repack
    monkeypatch.setattr(
        cont.ContinuousDecoder,
        "repack",
        lambda self, live: packs.append(live) or real(self, live),
    )
    limits = torch.tensor([3, 40, 3, 3, 20, 3])
    wide = _generate(thinker, batch, limits, max_slots=6)
    assert any(live <= 2 for live in packs)
    narrow = _generate(thinker, batch, limits, max_slots=1)
    assert torch.equal(wide.tokens, narrow.tokens) and wide.lengths.tolist() == limits.tolist()
    assert (wide.logprobs - narrow.logprobs).abs().max() <= TOL


def test_stop_token_ends_a_row_and_is_kept(thinker, batch):
    limits = torch.full((6,), 12)
    probe = _generate(thinker, batch, limits, max_slots=2)
    stop = int(probe.tokens[1, 2])  # the token row 1 drew third
    result = _generate(thinker, batch, limits, max_slots=2, stop_token_ids=[stop])
    assert result.finish_reasons[1] == "stop" and int(result.lengths[1]) <= 3
    assert result.tokens[1, int(result.lengths[1]) - 1] == stop


def test_greedy_continuous_equals_static(thinker, batch):
    media = dict(batch)
    ids, mask = media.pop("input_ids"), media.pop("attention_mask")
    kw = {"max_new_tokens": 6, "temperature": 0.0, "repeats": 2}
    static = generate(thinker, ids, mask, **kw, **media)
    cont = generate(thinker, ids, mask, batching="continuous", max_slots=4, **kw, **media)
    assert torch.equal(static.tokens, cont.tokens)
    assert (static.logprobs - cont.logprobs).abs().max() <= TOL


def test_noise_is_a_function_of_row_and_index():
    rows, index = torch.tensor([0, 5, 5]), torch.tensor([3, 3, 4])
    a = sample_noise(7, rows, index, 50)
    b = sample_noise(7, rows.flip(0), index.flip(0), 50).flip(0)
    assert torch.equal(a, b) and (a > 0).all() and torch.isfinite(a).all()
    assert not torch.equal(a[1], a[2]) and not torch.equal(a, sample_noise(8, rows, index, 50))
    # Exp(1): mean ~1 over many draws
    many = sample_noise(1, torch.arange(64), torch.zeros(64, dtype=torch.long), 4096)
    assert abs(float(many.mean()) - 1.0) < 0.02


_NOISE_CHECK = """
import torch
from omni_grpo.models.continuous import keyed_noise_torch
from omni_grpo.models.noise_kernel import keyed_noise

base = torch.tensor([0, 1, 2**32 - 1, 123456789, 2**31], dtype=torch.long)
for vocab in (50, 4096, 5000):
    got, want = keyed_noise(base, vocab), keyed_noise_torch(base, vocab)
    assert got.shape == want.shape, (got.shape, want.shape)
    # the same hash bits: -log of the same uniform, up to the two logs' last bits (a wrong hash
    # bit moves a draw by O(1))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
print("ok")
"""


def test_the_noise_kernel_draws_the_torch_hash_in_the_interpreter():
    """The CUDA path's one-kernel noise (``models.noise_kernel``) in Triton's interpreter: the
    torch function's values for keys at the 32-bit edges and for vocabularies across blocks."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run(
        [sys.executable, "-c", _NOISE_CHECK], env=env, capture_output=True, text=True, timeout=600
    )
    assert res.returncode == 0 and res.stdout.split()[-1] == "ok", res.stderr[-2000:]


@pytest.mark.gpu
def test_the_noise_kernel_draws_the_torch_hash_on_the_gpu():
    """The same on the device, at the released vocabulary; the kernel is what the decoder runs."""
    from omni_grpo.models.continuous import keyed_noise_torch, row_keys

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    rows = torch.arange(64, device="cuda")
    got = sample_noise(3, rows, rows * 7, 151936)
    key = row_keys(3, rows, rows * 7)
    torch.testing.assert_close(got, keyed_noise_torch(key, 151936), rtol=1e-6, atol=1e-7)


def test_a_slot_that_cannot_fit_is_refused_before_allocation(monkeypatch):
    import omni_grpo.models.continuous as cont

    layer = torch.zeros(2, 4, 3000, 128, dtype=torch.bfloat16)  # 2 prompts, 3000 columns
    pre = Prefilled(
        keys=[layer] * 48,
        values=[layer] * 48,
        mask=torch.ones(2, 3000, dtype=torch.bool),
        pos0=torch.zeros(2, dtype=torch.long),
        start=torch.zeros(2, dtype=torch.int32),
        logits=torch.zeros(2, 16),
    )
    monkeypatch.setattr(cont, "free_device_bytes", lambda device: 256 << 20)
    monkeypatch.setattr(cont, "device_total_and_allocated", lambda device: (140 << 30, 60 << 30))
    with pytest.raises(KVCacheTooLarge, match=r"3000 prompt \+ 4096 new tokens needs 0\.65 GiB"):
        plan_slots(pre, 256, 4096, torch.device("cuda"), cap=512)
    monkeypatch.setattr(cont, "free_device_bytes", lambda device: 40 << 30)
    assert plan_slots(pre, 256, 4096, torch.device("cuda"), cap=512) == 52
    assert plan_slots(pre, 16, 4096, torch.device("cuda"), cap=512) == 16
    # the ceiling: 0.5 of 140 GiB with 60 allocated leaves 10 GiB, not 0.85 of the 40 free
    assert plan_slots(pre, 256, 4096, torch.device("cuda"), 512, memory_utilization=0.5) == 15
    with pytest.raises(KVCacheTooLarge, match=r"memory_utilization 0\.4"):
        plan_slots(pre, 256, 4096, torch.device("cuda"), 512, memory_utilization=0.4)


@pytest.mark.parametrize("batching", ["static", "continuous"])
def test_a_prompt_past_the_context_is_refused_before_any_forward(thinker, batch, batching):
    media = dict(batch)
    ids, mask = media.pop("input_ids"), media.pop("attention_mask")
    longest = int(mask.sum(-1).max())
    context = thinker.config.text_config.max_position_embeddings
    with pytest.raises(ContextTooLong, match=f"a prompt of {longest} tokens plus .* {context} "):
        generate(thinker, ids, mask, max_new_tokens=context, batching=batching, **media)
