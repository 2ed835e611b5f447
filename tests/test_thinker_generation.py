"""KV-cached decoding with the composed thinker agrees with a teacher-forced forward.

The embedded rollout engine samples with ``forward(..., cache=...)`` steps and the trainer
recomputes logprobs without a cache; their agreement is what makes the rollout logprobs usable.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from omni_extract import extract
from omni_grpo.models import load_thinker
from omni_grpo.models.generation import generate, to_left_padding
from omni_grpo.testing.models import Ids, build_batch

TOL = 1e-5
TXT = [5, 6, 7]
SAMPLES = [
    [
        ("text", TXT),
        ("image", (1, 4, 4)),
        ("audio", 300),
        ("av", (2, 4, 4), 1.0, 120),
        ("text", TXT),
    ],
    [("text", TXT[:1]), ("audio", 150), ("text", TXT)],
    [
        ("text", TXT),
        ("video", (3, 4, 4), 0.75),
        ("audio", 101),
        ("image", (1, 4, 8)),
        ("text", [9]),
    ],
]


@pytest.fixture(scope="module")
def thinker(tiny_omni_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("thinker-gen")
    extract(tiny_omni_dir, root / "vl", variant="vl")
    extract(tiny_omni_dir, root / "audio", variant="audio")
    return load_thinker(root / "vl", dtype="float32")


def _ids(thinker) -> Ids:
    gen = json.loads((Path(thinker.source_dir) / "generation_config.json").read_text())
    return Ids.from_sideband(thinker.sideband.raw, pad=gen["pad_token_id"])


def _teacher_forced_logprobs(thinker, prompt_ids, prompt_mask, result, media, temperature):
    ids, mask = to_left_padding(prompt_ids, prompt_mask)
    n = result.tokens.shape[1]
    valid = torch.arange(n)[None] < result.lengths[:, None]
    full = torch.cat([ids, result.tokens], 1)
    full_mask = torch.cat([mask, valid.long()], 1)
    with torch.no_grad():
        logits = thinker(input_ids=full, attention_mask=full_mask, **media).logits
    start = ids.shape[1] - 1
    scaled = logits[:, start : start + n].float() / (temperature if temperature > 0 else 1.0)
    lp = torch.log_softmax(scaled, -1).gather(-1, result.tokens[:, :, None])[..., 0]
    return lp, valid, logits[:, start : start + n]


@pytest.mark.parametrize("padding_side", ["left", "right"])
def test_sampled_logprobs_match_teacher_forced(thinker, padding_side):
    batch = build_batch(SAMPLES, _ids(thinker), padding_side, seed=7)
    ids, mask = batch.pop("input_ids"), batch.pop("attention_mask")
    kw = {"max_new_tokens": 10, "temperature": 0.7, "top_k": 50, "top_p": 0.95}
    first = generate(thinker, ids, mask, generator=torch.Generator().manual_seed(0), **kw, **batch)
    # Stop on the token row 0 drew third: row 0 must now stop early, others may run to the end.
    stop = int(first.tokens[0, 2])
    result = generate(
        thinker,
        ids,
        mask,
        generator=torch.Generator().manual_seed(0),
        stop_token_ids=[stop],
        **kw,
        **batch,
    )
    assert result.finish_reasons[0] == "stop" and int(result.lengths[0]) <= 3
    assert result.tokens[0, : result.lengths[0]].tolist()[-1] == stop
    lp, valid, _ = _teacher_forced_logprobs(thinker, ids, mask, result, batch, 0.7)
    assert (lp - result.logprobs)[valid].abs().max() <= TOL
    assert (result.logprobs[~valid] == 0).all()


def test_greedy_equals_teacher_forced_argmax(thinker):
    batch = build_batch(SAMPLES, _ids(thinker), "left", seed=8)
    ids, mask = batch.pop("input_ids"), batch.pop("attention_mask")
    result = generate(thinker, ids, mask, max_new_tokens=6, temperature=0.0, **batch)
    _, _, logits = _teacher_forced_logprobs(thinker, ids, mask, result, batch, 0.0)
    logits = logits.clone()
    logits[..., thinker.sideband.banned_ids] = float("-inf")
    assert torch.equal(logits.argmax(-1), result.tokens)


def test_engine_style_decoding_without_mask(thinker):
    """What the embedded engine does: unpadded prompt, decode steps with only ``cache=``."""
    batch = build_batch([SAMPLES[0]] * 2, _ids(thinker), "left", seed=9)
    ids = batch.pop("input_ids")
    batch.pop("attention_mask")
    with torch.no_grad():
        out = thinker(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True, **batch)
        steps = [out.logits[:, -1]]
        new = []
        for _ in range(4):
            tok = steps[-1].argmax(-1)
            new.append(tok)
            out = thinker(input_ids=tok[:, None], use_cache=True, cache=out.cache)
            steps.append(out.logits[:, -1])
        full = torch.cat([ids, torch.stack(new, 1)], 1)
        forced = thinker(input_ids=full, attention_mask=torch.ones_like(full), **batch).logits
    cached = torch.stack(steps, 1)
    assert (cached - forced[:, ids.shape[1] - 1 :]).abs().max() <= TOL


def test_placeholders_are_never_sampled(thinker):
    """Make the audio placeholder the most likely token everywhere; it must still not appear."""
    biased = copy.deepcopy(thinker)
    audio = thinker.sideband.audio_token_id
    with torch.no_grad():
        biased.lm_head.weight[audio] = biased.lm_head.weight.abs().max() * 50
    ids = torch.tensor([TXT, TXT])
    allowed = generate(biased, ids, max_new_tokens=5, temperature=1.0, suppress_token_ids=[])
    assert (allowed.tokens == audio).any()  # the bias works
    result = generate(biased, ids, max_new_tokens=5, temperature=1.0)
    assert not torch.isin(result.tokens, torch.tensor(thinker.sideband.banned_ids)).any()
