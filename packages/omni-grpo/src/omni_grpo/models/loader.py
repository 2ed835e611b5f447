"""``load_thinker``: the composed Qwen3-Omni thinker from omni-extract's ``vl`` and ``audio`` outputs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from omni_audio_inject import AudioInjector, FrozenAudioTower
from omni_rope import OmniRopeConfig

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


def load_thinker(
    extracted_dir: str | Path,
    *,
    audio_dir: str | Path | None = None,
    dtype: str | torch.dtype | None = "auto",
    device: str | torch.device = "cpu",
    freeze_visual: bool = True,
    freeze_lm_head: bool = False,
    attn_implementation: str | None = None,
    experts_implementation: str | None = None,
) -> OmniThinker:
    """The Qwen3-Omni thinker from omni-extract's ``vl`` directory (plus its ``audio`` directory).

    ``audio_dir`` defaults to the location recorded by :func:`~omni_grpo.models.saving.save_thinker`, else the
    sibling ``<extracted_dir>/../audio`` (omni-extract's layout); the tower is read on the first
    forward that has audio, so text/image/video-only use needs no audio directory. ``dtype`` "auto"
    takes the checkpoint's dtype. The vision tower is frozen by default (``freeze_visual``).
    Returned in eval mode; call ``.train()`` for training. (The Megatron model is built by
    ``omni_grpo.backends.megatron`` from the same checkpoint.)
    """
    from transformers import AutoConfig, Qwen3VLMoeForConditionalGeneration

    extracted_dir = Path(extracted_dir)
    # Before anything is built: an Omni (not ``vl``) directory read as a VL config gets the
    # released model's default widths, and building that 30B model from a tiny test checkpoint
    # took 24 GB and an OOM kill of the test process.
    read_sideband(extracted_dir)
    config = AutoConfig.from_pretrained(extracted_dir)
    torch_dtype = _resolve_dtype(dtype, getattr(config, "dtype", None))
    kwargs: dict[str, Any] = {"dtype": torch_dtype}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if experts_implementation is not None:
        kwargs["experts_implementation"] = experts_implementation
    vl = Qwen3VLMoeForConditionalGeneration.from_pretrained(extracted_dir, **kwargs)
    vl.to(device)
    return wrap_vl(
        vl,
        extracted_dir,
        audio_dir=audio_dir,
        freeze_visual=freeze_visual,
        freeze_lm_head=freeze_lm_head,
        attn_implementation=attn_implementation,
    )


def wrap_vl(
    vl: torch.nn.Module,
    extracted_dir: str | Path,
    *,
    audio_dir: str | Path | None = None,
    freeze_visual: bool = True,
    freeze_lm_head: bool = False,
    attn_implementation: str | None = None,
) -> OmniThinker:
    """The thinker around an already built ``Qwen3VLMoeForConditionalGeneration``: sideband, rope
    config and audio tower come from ``extracted_dir`` (its ``config.json`` must describe ``vl``).

    ``load_thinker`` reads the weights first; a benchmark that draws random weights at real widths
    directly in GPU memory (``benchmarks/lora_memory.py``: 63 GB that need not touch a disk) wraps
    its module here.
    """
    extracted_dir = Path(extracted_dir)
    sideband = read_sideband(extracted_dir)
    config_dict = json.loads((extracted_dir / "config.json").read_text())
    audio_dir = Path(audio_dir) if audio_dir is not None else _default_audio_dir(extracted_dir)
    tower = FrozenAudioTower(audio_dir, attn_implementation=attn_implementation)
    injector = AudioInjector(tower, sideband.audio_token_id)
    # Positions are always explicit (``omni_rope.positions_from_mm`` in the thinker's forward), so
    # omni-rope's HF override (``install_omni_rope``, hooks on HF private generation methods) is
    # not installed: it stays a leaf feature for bare-HF users of ``thinker.vl``.
    rope_config = OmniRopeConfig.from_vl_config(config_dict)
    thinker = OmniThinker(vl, sideband, injector, rope_config, extracted_dir, audio_dir)
    thinker.set_frozen(visual=freeze_visual, lm_head=freeze_lm_head)
    thinker.train(False)
    return thinker
