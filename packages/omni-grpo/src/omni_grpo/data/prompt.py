"""Sample -> PromptInputs: chat template, media decoding and placeholder expansion.

The chat template writes ONE pad token per media item (``<|image_pad|>``, ``<|video_pad|>``,
``<|audio_pad|>``); we then repeat each pad to the item's token count — image/video ``t*h*w/4``,
audio the tower's output length — exactly what the Omni processor would produce, without needing
its torchvision-based video processor. A video of an audio-in-video row (``use_audio_in_video``)
brings its own sound track instead: its pad becomes ``<audio_start>`` + frame chunks and audio
tokens in time order (omni-rope's interleave, the processor's) + ``<audio_end>``. Token ids come
from the checkpoint's config.json (an omni-extract ``vl`` dir with ``omni_sideband``, or a hub
Omni dir with ``thinker_config``).
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from omni_rope import OmniRopeConfig, audio_in_video_segment_ids

from omni_grpo.data.ablation import ABLATIONS, neutralise
from omni_grpo.data.audio import audio_features, audio_tokens, whisper_kwargs
from omni_grpo.data.media import (
    MediaError,
    MediaLimits,
    Source,
    load_audio,
    load_image,
    load_video,
    load_video_audio,
    resolve_media,
)
from omni_grpo.data.schema import PLACEHOLDER
from omni_grpo.data.vision import (
    VisionProcessorConfig,
    process_frames,
    process_image,
    tokens_for_grid,
)
from omni_grpo.models.sideband import parse_sideband
from omni_grpo.types import PromptInputs, Sample

if TYPE_CHECKING:
    from omni_grpo.config import DataConfig

# Fetches the embedded bytes of a media item (``item["blob"]`` set); None when the cell holds no
# bytes, in which case the item's path is used.
BlobFetcher = Callable[[dict[str, Any]], bytes | None]

# media type -> config field holding its pad-token id
PAD_ID_FIELDS: dict[str, str] = {
    "image": "image_token_id",
    "video": "video_token_id",
    "audio": "audio_token_id",
}


@dataclass(frozen=True)
class ModelTokens:
    """The placeholder ids and audio window of the model the prompts are built for."""

    image_token_id: int
    video_token_id: int
    audio_token_id: int
    audio_n_window: int

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike[str]) -> ModelTokens:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"{path}: no config.json to read the placeholder token ids from"
            )
        cfg = json.loads(path.read_text())
        if "omni_sideband" in cfg:  # omni-extract vl/ (or text/) output
            side = parse_sideband(cfg, path)
            return cls(
                **{f: side.id(f) for f in PAD_ID_FIELDS.values()},
                audio_n_window=side.audio_n_window,
            )
        # The Omni hub layout keeps the same fields in its thinker config.
        src = cfg.get("thinker_config", cfg)
        where = "config.json thinker_config" if "thinker_config" in cfg else "config.json"
        missing = [f for f in PAD_ID_FIELDS.values() if f not in src]
        n_window = (src.get("audio_config") or {}).get("n_window")
        if n_window is None:
            missing.append("audio_config.n_window")
        if missing:
            raise ValueError(f"{path}: {where} lacks {missing}")
        return cls(**{f: int(src[f]) for f in PAD_ID_FIELDS.values()}, audio_n_window=int(n_window))


def _load_tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    if not getattr(tok, "chat_template", None):
        for name in ("chat_template.jinja", "chat_template.json"):
            p = model_dir / name
            if p.is_file():
                text = p.read_text()
                tok.chat_template = (
                    json.loads(text)["chat_template"] if name.endswith(".json") else text
                )
                break
    if not getattr(tok, "chat_template", None):
        raise ValueError(
            f"{model_dir}: the tokenizer has no chat template (chat_template.jinja/.json)"
        )
    return tok


class PromptBuilder:
    """Turns a Sample into model inputs; decodes its media on each call (nothing cached)."""

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        data: DataConfig,
        *,
        tokenizer: Any = None,
        system_prompt: str | None = None,
        ablate: frozenset[str] = frozenset(),
    ) -> None:
        self.model_dir = Path(model_dir)
        self.data = data
        self.tokenizer = tokenizer if tokenizer is not None else _load_tokenizer(self.model_dir)
        self.tokens = ModelTokens.from_dir(self.model_dir)
        self.image_cfg = VisionProcessorConfig.from_dir(self.model_dir)
        self.video_cfg = VisionProcessorConfig.from_dir(
            self.model_dir, "video_preprocessor_config.json"
        )
        self.whisper = whisper_kwargs(self.model_dir)
        self.system_prompt = system_prompt
        self.ablate = ablate  # media types replaced by a neutral input (omni_grpo.data.ablation)
        self._rope_config: OmniRopeConfig | None = None  # read on the first audio-in-video

    def ablated(self, name: str) -> PromptBuilder:
        """The same builder with the media of ablation ``name`` (``ABLATIONS``) made neutral."""
        if name not in ABLATIONS:
            raise ValueError(f"unknown ablation {name!r}; expected one of {sorted(ABLATIONS)}")
        out = copy.copy(self)
        out.ablate = self.ablate | ABLATIONS[name]
        return out

    # ------------------------------------------------------------------------------- text side
    def messages(self, sample: Sample) -> list[dict[str, Any]]:
        """The chat for a sample: its prompt split at ``<image>``/``<video>``/``<audio>`` into parts."""
        parts: list[dict[str, Any]] = []
        media = iter(sample.media)
        pos = 0
        for m in PLACEHOLDER.finditer(sample.prompt):
            if m.start() > pos:
                parts.append({"type": "text", "text": sample.prompt[pos : m.start()]})
            item = next(media)
            parts.append({"type": item["type"], item["type"]: item["path"]})
            pos = m.end()
        if pos < len(sample.prompt):
            parts.append({"type": "text", "text": sample.prompt[pos:]})
        msgs: list[dict[str, Any]] = []
        if self.system_prompt:
            msgs.append({"role": "system", "content": self.system_prompt})
        msgs.append({"role": "user", "content": parts})
        return msgs

    def template_ids(self, sample: Sample) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            self.messages(sample), add_generation_prompt=True, tokenize=False
        )
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    # ------------------------------------------------------------------------------ media side
    @property
    def limits(self) -> MediaLimits:
        d = self.data
        return MediaLimits(
            max_source_pixels=d.max_source_pixels,
            audio_max_seconds=d.audio_max_seconds,
            video_max_seconds=d.video_max_seconds,
        )

    @staticmethod
    def source(item: dict[str, Any], root: Path, blobs: BlobFetcher | None) -> Source:
        """The bytes of an embedded item, else its file (confined to ``root``)."""
        if item.get("blob") is not None:
            if blobs is None:
                raise MediaError(
                    "missing", f"{item.get('path') or 'item'}: embedded media without a reader"
                )
            data = blobs(item)
            if data is not None:
                return data
            if not item.get("path"):
                raise MediaError("missing", "embedded media item has neither bytes nor a path")
        return resolve_media(root, item["path"])

    def audio_in_video(self, sample: Sample) -> bool:
        """Whether the sample's videos bring their sound tracks: the row's own
        ``use_audio_in_video``, else ``data.use_audio_in_video`` (only where there is a video)."""
        if not any(item["type"] == "video" for item in sample.media):
            return False
        flag = sample.use_audio_in_video
        return bool(self.data.use_audio_in_video if flag is None else flag)

    @property
    def rope_config(self) -> OmniRopeConfig:
        """omni-rope's view of the checkpoint: the audio-in-video interleave is computed by the
        same code that positions it, so the layout and the position ids cannot disagree."""
        if self._rope_config is None:
            self._rope_config = OmniRopeConfig.from_pretrained_dir(self.model_dir)
        return self._rope_config

    def _media(
        self, sample: Sample, root: Path, blobs: BlobFetcher | None = None
    ) -> tuple[dict[str, list[Any]], list[list[int]]]:
        """Decode and process every media item; returns tensors per key and, per item, the token
        ids its one pad token of the chat template becomes.

        The prompt's audios (standalone ones and the videos' own tracks, in prompt order) go
        through the feature extractor in ONE call, as the Omni processor sends them: a batch pads
        every wave to the longest, which can give a shorter one a mel frame more (its length not
        a multiple of the hop) and so a placeholder more; one call per audio would not match.

        Anything the decoders or processors raise on an item is that item's ``MediaError``: the
        input is foreign, and one bad item must cost one row, never the run.
        """
        out: dict[str, list[Any]] = {
            k: [] for k in ("img", "img_grid", "vid", "vid_grid", "spg", "feat", "mask")
        }
        bodies: list[list[int]] = []
        waves: list[np.ndarray] = []
        # per wave: its item's index and, for a video's track, the video's (grid, seconds/grid)
        owners: list[tuple[int, tuple[torch.Tensor, float] | None]] = []
        with_audio = self.audio_in_video(sample)
        for k, item in enumerate(sample.media):
            src = self.source(item, root, blobs)
            name = None  # a file names itself (its resolved path)
            if item.get("blob") is not None:
                name = f"{sample.uid}: embedded {item['type']} {item.get('path') or ''}".rstrip()
            try:
                if item["type"] == "image":
                    bodies.append(self._image(src, name, out))
                    continue
                if item["type"] == "video":
                    bodies.append(self._video(src, name, out))
                    if not with_audio:
                        continue
                    owner = (out["vid_grid"][-1], out["spg"][-1])
                    waves.append(self._wave(load_video_audio, src, name, self._track_seconds))
                else:
                    bodies.append([])
                    owner = None
                    waves.append(self._wave(load_audio, src, name, self.limits.audio_max_seconds))
                owners.append((k, owner))
            except MediaError:
                raise
            except Exception as err:  # e.g. an image too small/elongated to resize
                raise MediaError(
                    "unreadable", f"{name or src}: {type(err).__name__}: {err}"
                ) from None
        if waves:
            try:
                self._audio_bodies(waves, owners, bodies, out)
            except Exception as err:  # the extractor or the interleave on foreign input
                raise MediaError(
                    "unreadable", f"sample {sample.uid!r}: audio: {type(err).__name__}: {err}"
                ) from None
        return out, bodies

    def _image(self, src: Source, name: str | None, out: dict[str, list[Any]]) -> list[int]:
        d = self.data
        image = load_image(src, self.limits.max_source_pixels, name)
        pv, grid = process_image(
            neutralise("image", image, self.ablate),
            self.image_cfg,
            d.image_max_pixels,
            d.image_min_pixels,
        )
        out["img"].append(pv)
        out["img_grid"].append(grid)
        return [self.tokens.image_token_id] * tokens_for_grid(grid, self.image_cfg.merge_size)

    def _video(self, src: Source, name: str | None, out: dict[str, list[Any]]) -> list[int]:
        """The frames' tensors; returns the pad's tokens when the video brings no sound."""
        d, lim = self.data, self.limits
        clip = neutralise(
            "video", load_video(src, d.video_fps, d.max_frames, name, lim), self.ablate
        )
        pv, grid = process_frames(clip.frames, self.video_cfg, max_pixels=d.video_max_pixels)
        out["vid"].append(pv)
        out["vid_grid"].append(grid)
        out["spg"].append(self.video_cfg.temporal_patch_size / clip.fps)
        return [self.tokens.video_token_id] * tokens_for_grid(grid, self.video_cfg.merge_size)

    @property
    def _track_seconds(self) -> float:
        """A video's track covers what its frames cover (the first ``video_max_seconds``), and no
        more than any audio may (``audio_max_seconds``)."""
        lim = self.limits
        return min(lim.audio_max_seconds or lim.video_max_seconds, lim.video_max_seconds)

    def _wave(
        self, loader: Callable[..., Any], src: Source, name: str | None, seconds: float | None
    ) -> np.ndarray:
        # the feature extractor's reflect padding needs more than half an STFT window
        min_samples = int(self.whisper.get("n_fft", 400)) // 2 + 1
        return neutralise("audio", loader(src, seconds, name, min_samples), self.ablate)

    def _audio_bodies(
        self,
        waves: list[np.ndarray],
        owners: list[tuple[int, tuple[torch.Tensor, float] | None]],
        bodies: list[list[int]],
        out: dict[str, list[Any]],
    ) -> None:
        """Features of all the prompt's waves in one call; then each audio's placeholders, and
        each video-with-sound's interleaved block (replacing its plain frame pads)."""
        feats, masks = audio_features(waves, self.whisper)
        for (k, video), feat, mask in zip(owners, feats, masks, strict=True):
            out["feat"].append(feat)
            out["mask"].append(mask)
            if video is None:
                n = audio_tokens(mask, self.tokens.audio_n_window)
                bodies[k] = [self.tokens.audio_token_id] * n
                continue
            grid, spg = video
            frames = int(mask.sum())
            # <vision_start> <audio_start> [frames / audio in time order] <audio_end> <vision_end>
            segment = audio_in_video_segment_ids(self.rope_config, grid, spg, frames)
            bodies[k] = segment[1:-1].tolist()  # the template already wrote the vision markers

    @staticmethod
    def _pack(out: dict[str, list[Any]]) -> dict[str, torch.Tensor]:
        mm: dict[str, torch.Tensor] = {}
        if out["img"]:
            mm["pixel_values"] = torch.cat(out["img"])
            mm["image_grid_thw"] = torch.stack(out["img_grid"])
        if out["vid"]:
            mm["pixel_values_videos"] = torch.cat(out["vid"])
            mm["video_grid_thw"] = torch.stack(out["vid_grid"])
            mm["video_second_per_grid"] = torch.tensor(out["spg"], dtype=torch.float32)
        if out["feat"]:
            t_max = max(f.shape[-1] for f in out["feat"])
            mm["input_features"] = torch.stack(
                [torch.nn.functional.pad(f, (0, t_max - f.shape[-1])) for f in out["feat"]]
            )
            mm["feature_attention_mask"] = torch.stack(
                [torch.nn.functional.pad(m, (0, t_max - m.shape[-1])) for m in out["mask"]]
            )
        return mm

    def expand(self, ids: list[int], sample: Sample, bodies: list[list[int]]) -> list[int]:
        """Replace the k-th pad token of each media type by the k-th item's tokens (``_media``)."""
        pad_of = {getattr(self.tokens, f): t for t, f in PAD_ID_FIELDS.items()}
        per_type: dict[str, list[list[int]]] = {t: [] for t in PAD_ID_FIELDS}
        for item, body in zip(sample.media, bodies, strict=True):
            per_type[item["type"]].append(body)
        found = {t: sum(1 for i in ids if pad_of.get(i) == t) for t in PAD_ID_FIELDS}
        wanted = {t: len(v) for t, v in per_type.items()}
        if found != wanted:
            raise ValueError(
                f"sample {sample.uid!r}: the chat template produced pad tokens {found} but the sample has media {wanted}"
            )
        out: list[int] = []
        cursor = dict.fromkeys(PAD_ID_FIELDS, 0)
        for i in ids:
            t = pad_of.get(i)
            if t is None:
                out.append(i)
                continue
            out.extend(per_type[t][cursor[t]])
            cursor[t] += 1
        return out

    def build(
        self, sample: Sample, root: str | os.PathLike[str], blobs: BlobFetcher | None = None
    ) -> PromptInputs:
        """Decode the sample's media (files under ``root``, embedded bytes through ``blobs``) and
        return its model inputs.

        Raises ``MediaError`` (with a counter ``reason``) for a missing, escaping, oversized or
        unreadable item.
        """
        out, bodies = self._media(sample, Path(root), blobs)
        ids = self.expand(self.template_ids(sample), sample, bodies)
        return PromptInputs(
            sample=sample,
            input_ids=ids,
            mm=self._pack(out),
            use_audio_in_video=self.audio_in_video(sample),
        )
