"""Loading the audio-tower checkpoint written by ``extract(..., variant="audio")``.

Layout (documented contract for omni-audio-inject): ``config.json`` is a
``Qwen3OmniMoeAudioEncoderConfig`` dict plus an ``omni_audio`` block (audio ids, time scaling,
``tensor_prefix``); the weights are the thinker's ``audio_tower.*`` tensors under that prefix
(``audio_tower.conv2d1.weight`` ...), unchanged. transformers' ``from_pretrained`` of the encoder
class does not strip that prefix, hence this helper.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from omni_extract.errors import ExtractError
from omni_extract.source import INDEX_FILE, SINGLE_FILE


def read_audio_checkpoint(
    path: str | os.PathLike[str],
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(config dict, state dict without the tensor prefix)`` of an audio-tower checkpoint."""
    root = Path(path)
    config = json.loads((root / "config.json").read_text())
    if config.get("model_type") != "qwen3_omni_moe_audio_encoder" or "omni_audio" not in config:
        raise ExtractError(
            f"{root / 'config.json'}: not an omni-extract audio checkpoint "
            f"(model_type {config.get('model_type')!r}, omni_audio block {'omni_audio' in config})"
        )
    prefix = config["omni_audio"]["tensor_prefix"]
    index = root / INDEX_FILE
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.is_file()
        else [SINGLE_FILE]
    )
    state: dict[str, torch.Tensor] = {}
    for fname in files:
        with safe_open(root / fname, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
                if not name.startswith(prefix):
                    raise ExtractError(
                        f"{root / fname}: tensor {name!r} lacks the prefix {prefix!r}"
                    )
                state[name.removeprefix(prefix)] = f.get_tensor(name)
    return config, state


def load_audio_tower(path: str | os.PathLike[str], dtype: torch.dtype | None = None) -> Any:
    """transformers' ``Qwen3OmniMoeAudioEncoder`` with the extracted weights (strict load)."""
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
        Qwen3OmniMoeAudioEncoderConfig,
    )
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeAudioEncoder

    config, state = read_audio_checkpoint(path)
    enc_config = Qwen3OmniMoeAudioEncoderConfig.from_pretrained(path)
    model = Qwen3OmniMoeAudioEncoder._from_config(
        enc_config, dtype=dtype or next(iter(state.values())).dtype
    )
    model.load_state_dict(state, strict=True)
    return model.eval()
