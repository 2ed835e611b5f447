"""The embedded engine: KV-cached sampling whose logprobs equal the trainer's full recompute."""

from __future__ import annotations

import pytest
import torch
from omni_grpo.config import DataConfig, ModelConfig, SamplingParams, TinyModelConfig
from omni_grpo.data.collate import repeat_mm
from omni_grpo.data.dataset import OmniDataset
from omni_grpo.data.prompt import PromptBuilder
from omni_grpo.data.synthetic import generate_synthetic
from omni_grpo.models.generation import sample_step
from omni_grpo.rollout import create_engine
from omni_grpo.rollout.embedded import EmbeddedEngine
from omni_grpo.trainer import media_token_ids, prepare_model


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, OmniDataset, int]:
    from omni_grpo.models import load_thinker

    root = tmp_path_factory.mktemp("embedded")
    model_cfg = ModelConfig(
        make_tiny=TinyModelConfig(), extracted_dir=root / "vl", audio_dir=root / "audio"
    )
    vl, audio = prepare_model(model_cfg, root)
    train, _ = generate_synthetic(root / "data", n_train=2, n_eval=2)
    data = DataConfig(train=train, root=train.parent)
    builder = PromptBuilder(vl, data)
    model = load_thinker(vl, audio_dir=audio)
    eos = int(builder.tokenizer.convert_tokens_to_ids("<|im_end|>"))
    return model, OmniDataset(train, train.parent, builder), eos


def _recompute(
    model: torch.nn.Module, prompt: object, tokens: list[int], temperature: float
) -> torch.Tensor:
    ids = torch.tensor([prompt.input_ids + tokens])
    with torch.no_grad():
        logits = model(
            input_ids=ids, attention_mask=torch.ones_like(ids), **repeat_mm(prompt.mm, 1)
        ).logits
    z = logits[0, len(prompt.input_ids) - 1 : -1].float() / temperature
    return torch.log_softmax(z, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_cached_logprobs_match_full_recompute(setup: tuple, temperature: float) -> None:
    model, ds, eos = setup
    engine = EmbeddedEngine(model, [eos], banned_token_ids=media_token_ids(model))
    torch.manual_seed(0)
    sampling = SamplingParams(temperature=temperature, max_new_tokens=6)
    seen = set()
    for i in range(len(ds)):  # image, audio and video prompts
        prompt = ds.load(i)
        seen.add(prompt.sample.modality)
        group = engine.generate([prompt], 3, sampling)[0]
        assert len(group) == 3
        for c in group:
            assert len(c.token_ids) == len(c.logprobs) >= 1
            ref = _recompute(model, prompt, c.token_ids, temperature)
            assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-4), (c.logprobs, ref)
            assert not set(c.token_ids) & set(media_token_ids(model))
    assert seen == {"image", "audio", "video"}


def test_eos_ends_a_sample_and_is_kept(setup: tuple) -> None:
    model, ds, eos = setup
    prompt = ds.load(0)
    # Every token stops: each sample is exactly one token long, finished by "stop".
    stop_all = list(range(model.lm_head.weight.shape[0]))
    engine = EmbeddedEngine(model, [eos])
    group = engine.generate([prompt], 4, SamplingParams(max_new_tokens=5, stop_token_ids=stop_all))[
        0
    ]
    assert all(len(c.token_ids) == 1 and c.finish_reason == "stop" for c in group)
    # No stop token reachable (all banned but never sampled): runs to max_new_tokens.
    group = EmbeddedEngine(model, [eos], banned_token_ids=[eos]).generate(
        [prompt], 2, SamplingParams(max_new_tokens=4)
    )[0]
    assert all(len(c.token_ids) == 4 and c.finish_reason == "length" for c in group)


def test_engine_shares_the_trainers_weights(setup: tuple) -> None:
    model, ds, eos = setup
    from omni_grpo.config import RolloutConfig

    engine = create_engine(RolloutConfig(), policy=model, eos_token_ids=[eos])
    assert isinstance(engine, EmbeddedEngine) and engine.model is model
    prompt = ds.load(0)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=1)
    before = engine.generate([prompt], 1, greedy)[0][0].token_ids[0]
    w = model.lm_head.weight
    target = (before + 1) % w.shape[0]
    saved = w.detach().clone()
    with torch.no_grad():  # swap two rows of the trainer's module: the argmax moves with them
        w[[before, target]] = saved[[target, before]]
    try:
        after = engine.generate([prompt], 1, greedy)[0][0].token_ids[0]
    finally:
        with torch.no_grad():
            model.lm_head.weight.copy_(saved)
    assert after == target


def test_sampling_filters() -> None:
    torch.manual_seed(0)
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]]).repeat(200, 1)
    tokens, lp = sample_step(logits, temperature=1.0, top_k=2)
    assert set(tokens.tolist()) <= {2, 3}
    assert torch.allclose(lp, torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0])
    tokens, _ = sample_step(logits, temperature=1.0, suppress=torch.tensor([3]))
    assert 3 not in tokens.tolist()
    tokens, _ = sample_step(logits, temperature=1.0, top_p=0.5)
    assert set(tokens.tolist()) == {3}  # p(3) = 0.64 >= 0.5
    tokens, lp = sample_step(logits[:2], temperature=0.0)
    assert tokens.tolist() == [3, 3]


def test_draw_is_torch_multinomial() -> None:
    """The sync-free draw picks exactly the tokens ``torch.multinomial`` picks from the same RNG."""
    logits = torch.randn(64, 97, generator=torch.Generator().manual_seed(1))
    ours, _ = sample_step(logits, temperature=0.8, generator=torch.Generator().manual_seed(2))
    probs = torch.softmax(logits / 0.8, -1)
    ref = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(2))[:, 0]
    assert torch.equal(ours, ref)


def test_groups_of_one_step_share_one_batch(setup: tuple) -> None:
    """Several prompts (image, audio, video: different lengths) sampled together: each group's
    logprobs still equal the unpadded full recompute of its own prompt."""
    model, ds, eos = setup
    engine = EmbeddedEngine(model, [eos])
    prompts = [ds.load(i) for i in range(len(ds))]
    assert len({len(p.input_ids) for p in prompts}) > 1  # left padding is exercised
    torch.manual_seed(1)
    groups = engine.generate(prompts, 2, SamplingParams(temperature=1.0, max_new_tokens=5))
    assert [g[0].prompt for g in groups] == prompts
    for prompt, group in zip(prompts, groups, strict=True):
        for c in group:
            ref = _recompute(model, prompt, c.token_ids, 1.0)
            assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-4), (c.logprobs, ref)


def test_unknown_engine_is_named() -> None:
    from omni_grpo.config import RolloutConfig

    cfg = RolloutConfig().model_copy(update={"engine": "warp-drive"})
    with pytest.raises(ValueError, match="warp-drive"):
        create_engine(cfg)
