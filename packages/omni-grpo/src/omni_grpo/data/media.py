"""Media decoding: Pillow for images, soundfile (wav/flac/ogg) or PyAV for audio, PyAV for video.

Everything is decoded on demand for one sample and returned as numpy arrays; nothing is cached.
All audio is resampled to mono 16 kHz float32 with PyAV's resampler (libswresample), the rate the
Whisper feature extractor expects. Paths are confined to the dataset root (``resolve_media``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np

AUDIO_RATE = 16_000
SOUNDFILE_SUFFIXES = frozenset({".wav", ".flac", ".ogg", ".aiff", ".aif"})


class MediaError(Exception):
    """A media file cannot be used; ``reason`` is a counter key (missing, escape, unreadable, empty)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


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


def load_image(path: Path):  # type: ignore[no-untyped-def]
    """RGB ``PIL.Image`` (fully loaded, file closed)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            return im.convert("RGB")
    except (UnidentifiedImageError, OSError) as err:
        raise MediaError("unreadable", f"cannot decode image {path}: {err}") from None


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


def _av_audio(path: Path, max_seconds: float | None) -> np.ndarray:
    import av

    chunks: list[np.ndarray] = []
    limit = None if max_seconds is None else int(max_seconds * AUDIO_RATE)
    got = 0
    with av.open(str(path)) as container:
        if not container.streams.audio:
            raise MediaError("unreadable", f"{path} has no audio stream")
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


def load_audio(path: Path, max_seconds: float | None = None) -> np.ndarray:
    """Mono float32 16 kHz waveform, truncated to ``max_seconds``; from a sound file or any container
    PyAV reads (mp3, m4a, the audio track of an mp4, ...)."""
    try:
        if path.suffix.lower() in SOUNDFILE_SUFFIXES:
            import soundfile as sf

            with sf.SoundFile(str(path)) as f:
                frames = -1 if max_seconds is None else int(max_seconds * f.samplerate)
                data = f.read(frames=frames, dtype="float32", always_2d=True)
                wave = resample_mono(data, f.samplerate)
        else:
            wave = _av_audio(path, max_seconds)
    except MediaError:
        raise
    except Exception as err:  # soundfile/PyAV raise many types for corrupt files
        raise MediaError(
            "unreadable", f"cannot decode audio {path}: {type(err).__name__}: {err}"
        ) from None
    if wave.size == 0:
        raise MediaError("empty", f"audio {path} has no samples")
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


def load_video(path: Path, fps: float, max_frames: int) -> VideoClip:
    """Frames sampled at ``fps`` (at most ``max_frames``), decoded in one streaming pass that keeps
    only the chosen frames: for each target time, the first frame at or after it (targets past the
    last frame repeat the last frame)."""
    import av

    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise MediaError("unreadable", f"{path} has no video stream")
            stream = container.streams.video[0]
            duration = _duration(container, stream)
            if not duration or duration <= 0:
                raise MediaError("unreadable", f"cannot determine the duration of video {path}")
            targets = sample_times(duration, fps, max_frames)
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
                raise MediaError("empty", f"video {path} has no frames")
            if len(picked) < len(targets):
                tail = last.to_ndarray(format="rgb24")
                picked.extend(tail for _ in range(len(targets) - len(picked)))
    except MediaError:
        raise
    except Exception as err:
        raise MediaError(
            "unreadable", f"cannot decode video {path}: {type(err).__name__}: {err}"
        ) from None
    eff_fps = fps if len(targets) < 2 else (len(targets) - 1) / float(targets[-1] - targets[0])
    return VideoClip(frames=np.stack(picked), fps=float(eff_fps))
