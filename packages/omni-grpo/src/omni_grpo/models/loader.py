"""``load_thinker``: the composed Qwen3-Omni thinker from omni-extract's ``vl`` and ``audio`` outputs."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from omni_audio_inject import AudioInjector, FrozenAudioTower
from omni_rope import OmniRopeConfig
from omni_rope.hf_vl import install_omni_rope

from omni_grpo.models.positions import RopeIndex
from omni_grpo.models.saving import recorded_audio_dir
from omni_grpo.models.sideband import read_sideband
from omni_grpo.models.thinker import OmniThinker

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
}


def _resolve_dtype(dtype: str | torch.dtype | None, config_dtype: Any) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        if isinstance(config_dtype, torch.dtype):
            return config_dtype
        return DTYPES.get(str(config_dtype), torch.float32)
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPES)} or 'auto'")
    return DTYPES[dtype]


def _default_audio_dir(extracted_dir: Path) -> Path:
    """A saved thinker's recorded tower, else omni-extract's sibling ``audio`` directory."""
    return recorded_audio_dir(extracted_dir) or extracted_dir.parent / "audio"


def _load_torch(
    extracted_dir: Path,
    *,
    audio_dir: Path | None,
    dtype: str | torch.dtype | None,
    device: str | torch.device,
    freeze_visual: bool,
    freeze_lm_head: bool,
    attn_implementation: str | None,
    experts_implementation: str | None,
) -> OmniThinker:
    from transformers import AutoConfig, Qwen3VLMoeForConditionalGeneration

    sideband = read_sideband(extracted_dir)
    config_dict = json.loads((extracted_dir / "config.json").read_text())
    config = AutoConfig.from_pretrained(extracted_dir)
    torch_dtype = _resolve_dtype(dtype, getattr(config, "dtype", None))
    kwargs: dict[str, Any] = {"dtype": torch_dtype}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if experts_implementation is not None:
        kwargs["experts_implementation"] = experts_implementation
    vl = Qwen3VLMoeForConditionalGeneration.from_pretrained(extracted_dir, **kwargs)
    vl.to(device)
    audio_dir = Path(audio_dir) if audio_dir is not None else _default_audio_dir(extracted_dir)
    tower = FrozenAudioTower(audio_dir, attn_implementation=attn_implementation)
    injector = AudioInjector(tower, sideband.audio_token_id)
    # omni-rope's override makes the bare VL object Omni-correct too (direct calls, HF generate()
    # for text/image/video); the thinker's own forward passes explicit positions from the same
    # config, so the override's hook is a pass-through there.
    handle = install_omni_rope(vl, OmniRopeConfig.from_vl_config(config_dict))
    thinker = OmniThinker(
        vl, sideband, injector, RopeIndex(handle.config), extracted_dir, audio_dir
    )
    thinker.rope_handle = handle
    thinker.set_frozen(visual=freeze_visual, lm_head=freeze_lm_head)
    thinker.train(False)
    return thinker


# Backends build the same thinker for different runtimes; Megatron's lives in
# omni_grpo.backends.megatron and plugs the same two attachments into a GPTModel.
BACKENDS: dict[str, Callable[..., OmniThinker]] = {"torch": _load_torch}


def load_thinker(
    extracted_dir: str | Path,
    *,
    audio_dir: str | Path | None = None,
    backend: str = "torch",
    dtype: str | torch.dtype | None = "auto",
    device: str | torch.device = "cpu",
    freeze_visual: bool = True,
    freeze_lm_head: bool = False,
    attn_implementation: str | None = None,
    experts_implementation: str | None = None,
) -> OmniThinker:
    """The Qwen3-Omni thinker from omni-extract's ``vl`` directory (plus its ``audio`` directory).

    ``audio_dir`` defaults to the location recorded by :meth:`OmniThinker.save_pretrained`, else the
    sibling ``<extracted_dir>/../audio`` (omni-extract's layout); the tower is read on the first
    forward that has audio, so text/image/video-only use needs no audio directory. ``dtype`` "auto"
    takes the checkpoint's dtype. The vision tower is frozen by default (``freeze_visual``).
    Returned in eval mode; call ``.train()`` for training.
    """
    if backend not in BACKENDS:
        raise ValueError(
            f"backend {backend!r} is not available for load_thinker; known: {sorted(BACKENDS)} "
            "(the Megatron model is built by omni_grpo.backends.megatron)"
        )
    extracted_dir = Path(extracted_dir)
    return BACKENDS[backend](
        extracted_dir,
        audio_dir=Path(audio_dir) if audio_dir is not None else None,
        dtype=dtype,
        device=device,
        freeze_visual=freeze_visual,
        freeze_lm_head=freeze_lm_head,
        attn_implementation=attn_implementation,
        experts_implementation=experts_implementation,
    )
