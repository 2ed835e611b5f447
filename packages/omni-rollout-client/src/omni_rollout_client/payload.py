"""Encode a prompt once, send it n times.

A GRPO group sends the same prompt (ids + processed media) n times. ``PreparedPrompt`` validates and
encodes the ids and the ``multimodal_train_inputs`` bundle once; each request then only serialises
its small varying part (sampling params, metadata) and the body is streamed as a list of byte
chunks that share the encoded tensors, so no per-request copy of a 100 MB video is ever made.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import ClientValidationError
from .tensors import FLOAT_WIRE_DTYPES, EncodedTensor, is_torch_tensor

# The 8 names sglang-omni 0.1.9's preprocessor accepts (anything else is a 400).
MM_TENSOR_NAMES: tuple[str, ...] = (
    "pixel_values",
    "image_grid_thw",
    "pixel_values_videos",
    "video_grid_thw",
    "video_second_per_grid",
    "input_features",
    "feature_attention_mask",
    "audio_feature_lengths",
)

# Payload tensor -> the meta tensors that are meaningless (server 400) without it.
PAYLOAD_OF_META: dict[str, str] = {
    "image_grid_thw": "pixel_values",
    "video_grid_thw": "pixel_values_videos",
    "video_second_per_grid": "pixel_values_videos",
    "feature_attention_mask": "input_features",
    "audio_feature_lengths": "input_features",
}

# Payload rows must equal sum(t*h*w) of the matching grid (one row per vision patch).
GRID_OF_PIXELS: dict[str, str] = {
    "pixel_values": "image_grid_thw",
    "pixel_values_videos": "video_grid_thw",
}

# Float tensors that may travel as bf16 (the encoders cast them to the model dtype anyway).
BF16_CASTABLE: frozenset[str] = frozenset({"pixel_values", "pixel_values_videos", "input_features"})

# Keys the server reads from metadata as media inputs or reserves for sessions (400 or silent
# media injection); trainer bookkeeping must never use them.
RESERVED_METADATA_KEYS: frozenset[str] = frozenset(
    {
        "images",
        "audios",
        "videos",
        "video_fps",
        "video_max_frames",
        "video_min_pixels",
        "video_max_pixels",
        "video_total_pixels",
        "use_audio_in_video",
        "omni_session",
    }
)

# HF processor outputs that are not part of the bundle (they are the request's input_ids).
PROCESSOR_ID_KEYS: frozenset[str] = frozenset({"input_ids", "attention_mask"})

TOKEN_ID_BOUND = 1 << 63


@dataclass(frozen=True)
class MediaTokenIds:
    """Placeholder ids that frame media in a Qwen3-Omni prompt (``thinker_config`` fields)."""

    vision_start: int
    vision_end: int
    audio_start: int
    audio_pad: int


# The released Qwen3-Omni thinker's ids (config.json ``thinker_config``); a checkpoint with other
# ids (the tiny test models) passes its own to the client.
QWEN3_OMNI_MEDIA_IDS = MediaTokenIds(
    vision_start=151652, vision_end=151653, audio_start=151669, audio_pad=151675
)


def check_no_audio_in_video(ids: Sequence[int], media_ids: MediaTokenIds | None) -> None:
    """Refuse audio placeholders inside a ``<vision_start> ... <vision_end>`` span.

    That is the processor's ``use_audio_in_video`` layout (a video's audio interleaved with its
    frames). sglang-omni 0.1.9's ``multimodal_train_inputs`` has no audio-in-video field, so the
    server would compute the M-RoPE positions of such a prompt as if audio and video were separate
    items — wrongly, and without an error.
    """
    if media_ids is None or not ids:
        return
    array = np.asarray(ids)
    starts = np.flatnonzero(array == media_ids.vision_start)
    if starts.size == 0:
        return
    ends = np.flatnonzero(array == media_ids.vision_end)
    audio = np.flatnonzero((array == media_ids.audio_pad) | (array == media_ids.audio_start))
    if audio.size == 0:
        return
    for start in starts.tolist():
        later_ends = ends[ends > start]
        end = int(later_ends[0]) if later_ends.size else len(ids)
        inside = audio[(audio > start) & (audio < end)]
        if inside.size:
            raise ClientValidationError(
                f"input_ids[{int(inside[0])}]: an audio placeholder inside the video span "
                f"starting at input_ids[{start}] (interleaved audio-in-video): the sglang-omni "
                "0.1.9 server has no audio-in-video field in multimodal_train_inputs and would "
                "place it wrongly; send the audio and the video as separate items"
            )


def _dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def normalize_input_ids(input_ids: Any, *, vocab_size: int | None = None) -> list[int]:
    """1-D ids from a list, numpy array or torch tensor; refuses what the server would 4xx."""
    if is_torch_tensor(input_ids):
        input_ids = input_ids.detach().cpu().numpy()
    array = np.asarray(input_ids)
    if array.ndim == 2 and array.shape[0] == 1:
        array = array[0]
    if array.ndim != 1 or array.size == 0:
        raise ClientValidationError(
            f"input_ids: expected a non-empty 1-D sequence of ints, got shape {array.shape}"
        )
    if array.dtype.kind not in "iu":
        raise ClientValidationError(f"input_ids: expected integer ids, got dtype {array.dtype}")
    ids = array.tolist()
    low, high = min(ids), max(ids)
    bound = TOKEN_ID_BOUND if vocab_size is None else vocab_size
    if low < 0 or high >= bound:
        bad = next(i for i, t in enumerate(ids) if not 0 <= t < bound)
        raise ClientValidationError(f"input_ids[{bad}] is {ids[bad]}, expected 0 <= id < {bound}")
    return ids


def _np_view(value: Any) -> np.ndarray:
    if is_torch_tensor(value):
        value = value.detach().cpu()
        if str(value.dtype) == "torch.bfloat16":
            value = value.float()
        return value.numpy()
    return np.asarray(value)


def validate_mm_tensors(mm: Mapping[str, Any]) -> dict[str, Any]:
    """Check names, shapes and cross-tensor consistency; derive ``audio_feature_lengths``."""
    unknown = sorted(set(mm) - set(MM_TENSOR_NAMES))
    if unknown:
        hint = (
            " (input_ids/attention_mask belong in input_ids; use PreparedPrompt.from_processor_output)"
            if set(unknown) & PROCESSOR_ID_KEYS
            else ""
        )
        raise ClientValidationError(
            f"multimodal tensors: unknown names {unknown}; sglang-omni accepts {list(MM_TENSOR_NAMES)}{hint}"
        )
    tensors = {k: v for k, v in mm.items() if v is not None}
    for name, value in tensors.items():
        if 0 in tuple(np.shape(value)):
            raise ClientValidationError(
                f"tensor {name!r}: zero-element shape {tuple(np.shape(value))} (sglang-omni answers 500)"
            )
    for meta, payload in PAYLOAD_OF_META.items():
        if meta in tensors and payload not in tensors:
            raise ClientValidationError(
                f"tensor {meta!r} given without {payload!r} (sglang-omni answers 400)"
            )
    for pixels, grid in GRID_OF_PIXELS.items():
        if pixels in tensors:
            if grid not in tensors:
                raise ClientValidationError(f"tensor {pixels!r} given without {grid!r}")
            grid_np = _np_view(tensors[grid])
            if grid_np.ndim != 2 or grid_np.shape[1] != 3:
                raise ClientValidationError(
                    f"tensor {grid!r}: expected shape [n, 3], got {list(grid_np.shape)}"
                )
            rows = int(np.prod(grid_np.astype(np.int64), axis=1).sum())
            got = int(np.shape(tensors[pixels])[0])
            if rows != got:
                raise ClientValidationError(
                    f"tensor {pixels!r}: {got} patch rows, but {grid!r} implies {rows}"
                )
    if "feature_attention_mask" in tensors:
        mask = _np_view(tensors["feature_attention_mask"])
        if mask.ndim != 2:
            raise ClientValidationError(
                f"tensor 'feature_attention_mask': expected 2-D [n_audio, frames], got shape {list(mask.shape)} (1-D is a 500 on sglang-omni)"
            )
        feat_shape = tuple(np.shape(tensors["input_features"]))
        if len(feat_shape) != 3 or feat_shape[0] != mask.shape[0] or feat_shape[2] != mask.shape[1]:
            raise ClientValidationError(
                f"tensor 'input_features' shape {list(feat_shape)} does not match feature_attention_mask {list(mask.shape)} (expected [n_audio, mel, frames])"
            )
        if "audio_feature_lengths" not in tensors:
            tensors["audio_feature_lengths"] = mask.astype(np.int64).sum(axis=1)
    return tensors


@dataclass(frozen=True, eq=False)
class PreparedPrompt:
    """A prompt validated and encoded once; pass it to every ``generate`` of its group."""

    input_ids: tuple[int, ...]
    tensors: Mapping[str, EncodedTensor] = field(default_factory=dict)
    ids_json: bytes = b""

    @classmethod
    def build(
        cls,
        input_ids: Any,
        mm: Mapping[str, Any] | None = None,
        *,
        bf16: bool | Iterable[str] = True,
        vocab_size: int | None = None,
        use_audio_in_video: bool = False,
        media_ids: MediaTokenIds | None = QWEN3_OMNI_MEDIA_IDS,
    ) -> PreparedPrompt:
        """Validate and encode.

        Audio-in-video prompts are refused (``use_audio_in_video=True``, or ids whose video span
        holds audio placeholders, found with ``media_ids``): the 0.1.9 server has no field for it.

        ``bf16=True`` casts the float payload tensors (pixels, mel features) to bfloat16, halving
        the wire bytes; the trainer must then use ``trainer_tensors()`` so it sees the same rounded
        values. Pass an iterable of names to cast only those, or ``False`` to send dtypes as given.
        """
        if use_audio_in_video:
            raise ClientValidationError(
                "use_audio_in_video=True cannot be expressed in multimodal_train_inputs (sglang-omni 0.1.9 has no field for it); send audio and video as separate items"
            )
        ids = normalize_input_ids(input_ids, vocab_size=vocab_size)
        check_no_audio_in_video(ids, media_ids)
        tensors = validate_mm_tensors(mm or {})
        cast = BF16_CASTABLE if bf16 is True else frozenset() if bf16 is False else frozenset(bf16)
        if cast - BF16_CASTABLE:
            raise ClientValidationError(
                f"bf16: only {sorted(BF16_CASTABLE)} may be cast, got {sorted(cast - BF16_CASTABLE)}"
            )
        encoded: dict[str, EncodedTensor] = {}
        for name in MM_TENSOR_NAMES:
            if name in tensors:
                enc = EncodedTensor.encode(name, tensors[name], bf16=name in cast)
                if name in cast and enc.dtype not in FLOAT_WIRE_DTYPES:
                    raise ClientValidationError(
                        f"tensor {name!r}: expected a float tensor, got {enc.dtype}"
                    )
                encoded[name] = enc
        return cls(input_ids=tuple(ids), tensors=encoded, ids_json=_dumps(ids))

    @classmethod
    def from_processor_output(cls, batch: Mapping[str, Any], **kwargs: Any) -> PreparedPrompt:
        """Build from a HF processor output for ONE prompt (``input_ids`` of shape [1, L] or [L]);
        ``attention_mask`` must be all ones (an unpadded single prompt)."""
        if "input_ids" not in batch:
            raise ClientValidationError("processor output has no 'input_ids'")
        mask = batch.get("attention_mask")
        if mask is not None and not bool(np.all(_np_view(mask) == 1)):
            raise ClientValidationError(
                "processor output: attention_mask has padding; pass one unpadded prompt"
            )
        mm = {k: v for k, v in batch.items() if k not in PROCESSOR_ID_KEYS}
        return cls.build(batch["input_ids"], mm, **kwargs)

    @property
    def bundle_nbytes(self) -> int:
        """Raw (decoded) bytes of the tensors the server receives."""
        return sum(t.nbytes for t in self.tensors.values())

    def bundle_chunks(self) -> list[bytes]:
        """``{"version":1,"tensors":{...}}`` as byte chunks (empty list when text-only)."""
        if not self.tensors:
            return []
        chunks: list[bytes] = [b'{"version":1,"tensors":{']
        for i, (name, enc) in enumerate(self.tensors.items()):
            chunks.append(b'%s"%s":' % (b"," if i else b"", name.encode()))
            chunks.extend(enc.json_chunks())
        chunks.append(b"}}")
        return chunks

    def trainer_tensors(self) -> dict[str, Any]:
        """The exact tensors the server decodes, as torch tensors (imports torch)."""
        return {name: enc.to_torch() for name, enc in self.tensors.items()}

    def trainer_arrays(self) -> dict[str, np.ndarray]:
        """The exact values the server decodes, as numpy (bf16 widened exactly to float32)."""
        return {name: enc.values() for name, enc in self.tensors.items()}

    def continued(self, generated_ids: Sequence[int]) -> PreparedPrompt:
        """The same prompt with already generated ids appended (for partial-rollout resume);
        the encoded tensors are shared, not re-encoded."""
        ids = self.input_ids + tuple(int(t) for t in generated_ids)
        return PreparedPrompt(input_ids=ids, tensors=self.tensors, ids_json=_dumps(list(ids)))


def check_metadata(metadata: Mapping[str, Any] | None) -> bytes:
    """Serialise metadata, refusing keys the server treats as media or sessions."""
    if metadata is None:
        return b"null"
    if not isinstance(metadata, Mapping):
        raise ClientValidationError(f"metadata: expected a mapping, got {type(metadata).__name__}")
    reserved = sorted(RESERVED_METADATA_KEYS & set(metadata))
    if reserved:
        raise ClientValidationError(
            f"metadata uses keys sglang-omni reserves for media/sessions: {reserved}; rename them"
        )
    try:
        return _dumps(dict(metadata))
    except (TypeError, ValueError) as exc:
        raise ClientValidationError(f"metadata is not JSON-serialisable: {exc}") from exc


def build_generate_body(
    prompt: PreparedPrompt,
    sampling_params: Mapping[str, Any],
    *,
    metadata: Mapping[str, Any] | None = None,
    model: str | None = None,
) -> list[bytes]:
    """The /generate JSON body as chunks; ``b"".join(chunks)`` is the full document.

    ``sampling_params`` must already be filtered (see ``sampling.filter_sampling_params``).
    """
    head = [
        b'{"input_ids":',
        prompt.ids_json,
        b',"sampling_params":',
        _dumps(dict(sampling_params)),
        b',"metadata":',
        check_metadata(metadata),
        b',"output_modalities":["text"],"return_logprob":true,"stream":false',
    ]
    if model is not None:
        head.append(b',"model":' + _dumps(model))
    bundle = prompt.bundle_chunks()
    if bundle:
        return [*head, b',"multimodal_train_inputs":', *bundle, b"}"]
    return [*head, b"}"]
