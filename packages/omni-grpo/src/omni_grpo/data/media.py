"""Media decoding: Pillow for images, soundfile (wav/flac/ogg/aiff) or PyAV for audio, PyAV for video.

Everything is decoded on demand for one sample and returned as numpy arrays; nothing is cached.
A source is a file (``Path``) or the bytes of one embedded item (a parquet / ``datasets`` cell),
decoded in memory through the SAME code, so a row trains identically from either form: the audio
decoder is chosen from the content's magic bytes, never from a file name.

All audio is resampled to mono 16 kHz float32 with PyAV's resampler (libswresample), the rate the
Whisper feature extractor expects. Paths are confined to the dataset root (``resolve_media``).

Every failure is a ``MediaError`` whose ``reason`` is a counter key (the dataset skips and counts
the row): hostile or broken input raises all kinds of exceptions inside the decoders, so they are
caught broadly here, at the one boundary where the input is foreign. The limits are ours and
explicit (``MediaLimits``, from ``DataConfig``), not the libraries' defaults: PIL's
decompression-bomb threshold is replaced by ``max_source_pixels``, checked from the header
before anything is decoded.
"""

from __future__ import annotations

import io
import os
import re
import warnings
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

AUDIO_RATE = 16_000
# Content sniffing -> decoder. libsndfile reads these containers; everything else goes to PyAV.
SOUNDFILE_MAGIC: tuple[tuple[int, bytes], ...] = (
    (0, b"RIFF"),
    (0, b"RIFX"),
    (0, b"RF64"),
    (0, b"fLaC"),
    (0, b"OggS"),
    (0, b"FORM"),
)
# Pillow raises DecompressionBombError above 2 * Image.MAX_IMAGE_PIXELS (default 89,478,485); our
# own limit may not exceed it, so Pillow never refuses an image our limit allows.
PIL_BOMB_PIXELS = 2 * 89_478_485
DEFAULT_MAX_SOURCE_PIXELS = 64_000_000
DEFAULT_VIDEO_MAX_SECONDS = 600.0

Source = Path | bytes


class MediaError(Exception):
    """A media item cannot be used; ``reason`` is a counter key.

    Reasons: ``missing`` (no such file / no bytes), ``escape`` (outside the root), ``unreadable``
    (decoder failed), ``empty`` (no samples/frames), ``too_large`` (over ``max_source_pixels``),
    ``too_short`` (audio shorter than one STFT window), ``no_audio_track`` (a video whose row
    sets ``use_audio_in_video`` has no sound track).
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class MediaLimits:
    """Explicit decode limits (documented in ``DataConfig``), applied to files and bytes alike."""

    max_source_pixels: int = DEFAULT_MAX_SOURCE_PIXELS  # images and video frames, before decoding
    audio_max_seconds: float | None = None  # longer audio is truncated
    video_max_seconds: float = DEFAULT_VIDEO_MAX_SECONDS  # frames are sampled from this prefix


_BYTESIO_REPR = re.compile(r"<_io\.BytesIO object at 0x[0-9a-f]+>")


def _why(err: Exception) -> str:
    """The decoder's message, without the in-memory file's repr it quotes for embedded bytes."""
    return f"{type(err).__name__}: {_BYTESIO_REPR.sub('the bytes', str(err))}"


def _label(src: Source, name: str | None) -> str:
    if name:
        return name
    return str(src) if isinstance(src, Path) else f"<{len(src)} embedded bytes>"


def _open_arg(src: Source) -> Any:
    """What a decoder opens: the path string, or an in-memory file over the bytes."""
    return str(src) if isinstance(src, Path) else io.BytesIO(src)


def _head(src: Source, n: int = 12) -> bytes:
    if isinstance(src, Path):
        with src.open("rb") as f:
            return f.read(n)
    return bytes(src[:n])


def resolve_media(root: str | os.PathLike[str], rel: str) -> Path:
    """``root / rel`` with symlinks resolved, refused unless it stays inside the resolved root.

    Absolute paths and ``..`` are allowed only if they still land inside the root; a symlink that
    points outside is refused too, since the check runs on the fully resolved path.
    """
    base = Path(root).resolve()
    target = (base / rel).resolve()
    if not target.is_relative_to(base):
        raise MediaError(
            "escape", f"media path {rel!r} resolves to {target}, outside the dataset root {base}"
        )
    if not target.is_file():
        raise MediaError("missing", f"media file {rel!r} not found under {base}")
    return target


def load_image(src: Source, max_pixels: int = DEFAULT_MAX_SOURCE_PIXELS, name: str | None = None):  # type: ignore[no-untyped-def]
    """RGB ``PIL.Image`` (fully loaded, file closed); refused above ``max_pixels`` source pixels."""
    from PIL import Image

    what = _label(src, name)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(_open_arg(src)) as im:
                w, h = im.size
                if w * h > max_pixels:
                    raise MediaError(
                        "too_large",
                        f"image {what} is {w}x{h} = {w * h} pixels, over the limit of "
                        f"{max_pixels} (data.max_source_pixels)",
                    )
                return im.convert("RGB")
    except MediaError:
        raise
    except Image.DecompressionBombError as err:
        raise MediaError("too_large", f"image {what}: {err}") from None
    except Exception as err:  # Pillow raises OSError, ValueError, SyntaxError, struct.error, ...
        raise MediaError("unreadable", f"cannot decode image {what}: {_why(err)}") from None


def resample_mono(wave: np.ndarray, rate: int, target: int = AUDIO_RATE) -> np.ndarray:
    """Mono float32 at ``target`` Hz. ``wave`` is ``[n]`` or ``[n, channels]`` (channels averaged)."""
    x = np.asarray(wave, dtype=np.float32)
    if x.ndim == 2:
        x = x.mean(axis=1)
    if rate == target or x.size == 0:
        return np.ascontiguousarray(x)
    import av

    frame = av.AudioFrame.from_ndarray(x[None, :], format="flt", layout="mono")
    frame.sample_rate = rate
    resampler = av.AudioResampler(format="flt", layout="mono", rate=target)
    out = [f.to_ndarray()[0] for f in resampler.resample(frame)]
    out += [f.to_ndarray()[0] for f in resampler.resample(None)]  # flush the filter tail
    return np.concatenate(out).astype(np.float32) if out else np.zeros(0, np.float32)


def _av_audio(src: Source, what: str, max_seconds: float | None) -> np.ndarray:
    import av

    chunks: list[np.ndarray] = []
    limit = None if max_seconds is None else int(max_seconds * AUDIO_RATE)
    got = 0
    with av.open(_open_arg(src)) as container:
        if not container.streams.audio:
            raise MediaError("unreadable", f"{what} has no audio stream")
        resampler = av.AudioResampler(format="flt", layout="mono", rate=AUDIO_RATE)
        for frame in container.decode(audio=0):
            for f in resampler.resample(frame):
                chunks.append(f.to_ndarray()[0])
                got += chunks[-1].size
            if limit is not None and got >= limit:
                break
        for f in resampler.resample(None):
            chunks.append(f.to_ndarray()[0])
    wave = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
    return wave[:limit] if limit is not None else wave


def _soundfile_audio(src: Source, max_seconds: float | None) -> np.ndarray:
    import soundfile as sf

    with sf.SoundFile(_open_arg(src)) as f:
        frames = -1 if max_seconds is None else int(max_seconds * f.samplerate)
        data = f.read(frames=frames, dtype="float32", always_2d=True)
        return resample_mono(data, f.samplerate)


def uses_soundfile(head: bytes) -> bool:
    """Whether libsndfile decodes this content (by its magic bytes): the same rule for a file and
    for embedded bytes, so both decode through the same library."""
    return any(head[at : at + len(magic)] == magic for at, magic in SOUNDFILE_MAGIC)


def load_audio(
    src: Source,
    max_seconds: float | None = None,
    name: str | None = None,
    min_samples: int = 1,
) -> np.ndarray:
    """Mono float32 16 kHz waveform, truncated to ``max_seconds``; from a sound file or any container
    PyAV reads (mp3, m4a, the audio track of an mp4, ...). Fewer than ``min_samples`` samples (the
    feature extractor needs more than half an STFT window) is ``too_short``; NaN/inf is refused."""
    what = _label(src, name)
    try:
        if uses_soundfile(_head(src)):
            wave = _soundfile_audio(src, max_seconds)
        else:
            wave = _av_audio(src, what, max_seconds)
    except MediaError:
        raise
    except Exception as err:  # soundfile/PyAV raise many types for corrupt files
        raise MediaError("unreadable", f"cannot decode audio {what}: {_why(err)}") from None
    return _checked_wave(wave, f"audio {what}", min_samples)


def load_video_audio(
    src: Source,
    max_seconds: float | None = None,
    name: str | None = None,
    min_samples: int = 1,
) -> np.ndarray:
    """A video's own sound track (``use_audio_in_video``) as ``load_audio`` returns audio: mono
    float32 16 kHz, truncated to ``max_seconds``.

    Always decoded by PyAV (a video container is never a libsndfile file, whatever its first
    bytes), and a video without an audio stream is its own ``no_audio_track`` error naming the
    file: the row asked for a sound track that is not there, which is not a decoding failure.
    """
    import av

    what = _label(src, name)
    try:
        with av.open(_open_arg(src)) as container:
            has_audio = bool(container.streams.audio)
    except Exception as err:
        raise MediaError("unreadable", f"cannot open video {what}: {_why(err)}") from None
    if not has_audio:
        raise MediaError(
            "no_audio_track",
            f"video {what} has no sound track, but its row sets use_audio_in_video "
            "(set it false for this row, or data.use_audio_in_video false)",
        )
    try:
        wave = _av_audio(src, what, max_seconds)
    except MediaError:
        raise
    except Exception as err:
        raise MediaError(
            "unreadable", f"cannot decode the sound track of {what}: {_why(err)}"
        ) from None
    return _checked_wave(wave, f"the sound track of video {what}", min_samples)


def _checked_wave(wave: np.ndarray, what: str, min_samples: int) -> np.ndarray:
    """``wave`` unless it is empty, shorter than ``min_samples`` or not finite (a ``MediaError``)."""
    if wave.size == 0:
        raise MediaError("empty", f"{what} has no samples")
    if wave.size < min_samples:
        raise MediaError(
            "too_short",
            f"{what} has {wave.size} samples at {AUDIO_RATE} Hz, fewer than the "
            f"{min_samples} the feature extractor needs",
        )
    if not np.isfinite(wave).all():
        raise MediaError("unreadable", f"{what} contains NaN or infinite samples")
    return wave


@dataclass
class VideoClip:
    frames: np.ndarray  # [T, H, W, 3] uint8 RGB
    fps: float  # effective sampling rate of ``frames`` (frames per second of source time)


def sample_times(duration: float, fps: float, max_frames: int) -> np.ndarray:
    """Timestamps (s) at ``fps`` over ``[0, duration)``; when more than ``max_frames`` would be
    taken, ``max_frames`` evenly spaced ones instead (the effective fps drops accordingly)."""
    n = max(1, int(np.floor(duration * fps + 1e-9)))
    if n <= max_frames:
        return np.arange(n) / fps
    return np.linspace(0.0, duration, max_frames, endpoint=False)


def _duration(container, stream) -> float | None:  # type: ignore[no-untyped-def]
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return container.duration / 1_000_000  # av.time_base
    if stream.frames and stream.average_rate:
        return stream.frames / float(stream.average_rate)
    return None


def load_video(
    src: Source,
    fps: float,
    max_frames: int,
    name: str | None = None,
    limits: MediaLimits | None = None,
) -> VideoClip:
    """Frames sampled at ``fps`` (at most ``max_frames``) from the first ``video_max_seconds``,
    decoded in one streaming pass that keeps only the chosen frames: for each target time, the
    first frame at or after it (targets past the last frame repeat the last frame). Frames over
    ``max_source_pixels`` are refused from the stream header, before decoding."""
    import av

    lim = limits or MediaLimits()
    what = _label(src, name)
    try:
        with av.open(_open_arg(src)) as container:
            if not container.streams.video:
                raise MediaError("unreadable", f"{what} has no video stream")
            stream = container.streams.video[0]
            w, h = stream.codec_context.width or 0, stream.codec_context.height or 0
            if w * h > lim.max_source_pixels:
                raise MediaError(
                    "too_large",
                    f"video {what} has {w}x{h} = {w * h} pixel frames, over the limit of "
                    f"{lim.max_source_pixels} (data.max_source_pixels)",
                )
            duration = _duration(container, stream)
            if not duration or duration <= 0:
                raise MediaError("unreadable", f"cannot determine the duration of video {what}")
            targets = sample_times(min(duration, lim.video_max_seconds), fps, max_frames)
            tb = stream.time_base or Fraction(1, 1_000_000)
            picked: list[np.ndarray] = []
            start: float | None = None
            last = None
            for n, frame in enumerate(container.decode(video=0)):
                t = (
                    float(frame.pts * tb)
                    if frame.pts is not None
                    else n / float(stream.average_rate or 25)
                )
                start = t if start is None else start
                last = frame
                while len(picked) < len(targets) and targets[len(picked)] <= t - start + 1e-6:
                    picked.append(frame.to_ndarray(format="rgb24"))
                if len(picked) == len(targets):
                    break
            if last is None:
                raise MediaError("empty", f"video {what} has no frames")
            if len(picked) < len(targets):
                tail = last.to_ndarray(format="rgb24")
                picked.extend(tail for _ in range(len(targets) - len(picked)))
    except MediaError:
        raise
    except Exception as err:
        raise MediaError("unreadable", f"cannot decode video {what}: {_why(err)}") from None
    eff_fps = fps if len(targets) < 2 else (len(targets) - 1) / float(targets[-1] - targets[0])
    return VideoClip(frames=np.stack(picked), fps=float(eff_fps))
