"""A tiny Omni policy with real rollout groups, for backend tests.

``rollout_world(root)`` makes the tiny checkpoint, extracts it, writes the synthetic image /
audio / video set, loads the torch thinker and samples ``n`` completions for each of the first
``n_prompts`` prompts with the embedded engine: the same inputs the loop hands a backend.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def rollout_world(
    root: Path, *, n_prompts: int = 3, n: int = 4, max_new_tokens: int = 4, seed: int = 0
) -> dict[str, Any]:
    """``{"vl", "audio", "model_cfg", "base", "prompts", "groups", "eos"}`` under ``root``."""
    from omni_grpo.config import DataConfig, ModelConfig, SamplingParams, TinyModelConfig
    from omni_grpo.data.dataset import OmniDataset
    from omni_grpo.data.prompt import PromptBuilder
    from omni_grpo.data.synthetic import generate_synthetic
    from omni_grpo.models import load_thinker
    from omni_grpo.rollout.embedded import EmbeddedEngine
    from omni_grpo.trainer import media_token_ids, prepare_model

    model_cfg = ModelConfig(
        make_tiny=TinyModelConfig(), extracted_dir=root / "vl", audio_dir=root / "audio"
    )
    vl, audio = prepare_model(model_cfg, root)
    train, _ = generate_synthetic(root / "data", n_train=2, n_eval=2)
    builder = PromptBuilder(vl, DataConfig(train=train, root=train.parent))
    ds = OmniDataset(train, train.parent, builder)
    eos = int(builder.tokenizer.convert_tokens_to_ids("<|im_end|>"))
    base = load_thinker(vl, audio_dir=audio)
    torch.manual_seed(seed)
    engine = EmbeddedEngine(base, [eos], banned_token_ids=media_token_ids(base))
    prompts = [ds.load(i) for i in range(n_prompts)]
    groups = engine.generate(prompts, n, SamplingParams(max_new_tokens=max_new_tokens))
    return {
        "vl": vl,
        "audio": audio,
        "model_cfg": model_cfg,
        "base": base,
        "prompts": prompts,
        "groups": groups,
        "eos": eos,
        "engine": engine,
    }
