"""A synthetic perception dataset whose answers can only be read off the media.

Three binary multiple-choice tasks, one per modality, written as real media files so that the whole
data path (PyAV / soundfile / Pillow decoding, placeholder expansion, processor tensors) is
exercised exactly as for a real dataset:

- image: the dominant colour of a PNG (red or blue background, with distractor blocks of other
  colours covering less than a third of the picture);
- audio: the pitch of a 2 s WAV tone (low 200-320 Hz or high 2.5-3.5 kHz, random amplitude,
  phase and noise);
- video: the horizontal motion direction of a light vertical bar in a 2 s MP4 (left-to-right or
  right-to-left, across the whole frame, random background), which no single frame reveals.

The prompt text of a task is identical for every row and the two classes are balanced per split,
so a policy that ignores the media cannot beat chance. Labels are the option letters ("A"/"B").
Rows follow ``omni_grpo.types.Sample`` (uid, prompt, label, media, choices, reward, modality,
metadata); prompts carry one ``<image>``/``<audio>``/``<video>`` placeholder per media item.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from omni_grpo.atomic_dir import staged_dir

LETTERS = ("A", "B")
AUDIO_SAMPLE_RATE = 16_000


@dataclass(frozen=True)
class TaskSpec:
    """One synthetic task: the fixed question, the two answers (option order = label letters)."""

    modality: str
    question: str
    answers: tuple[str, str]
    suffix: str  # media file extension


TASKS: dict[str, TaskSpec] = {
    "image": TaskSpec("image", "What is the dominant colour of the image?", ("red", "blue"), "png"),
    "audio": TaskSpec("audio", "Is the tone high or low?", ("low", "high"), "wav"),
    "video": TaskSpec("video", "Which way does the square move?", ("left", "right"), "mp4"),
}

IMAGE_SIZE = 64
VIDEO_SIZE = 64
VIDEO_FPS = 8
VIDEO_FRAMES = 16  # 2 seconds
AUDIO_SECONDS = 2.0
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "blue": (30, 60, 220),
}
DISTRACTORS: tuple[tuple[int, int, int], ...] = ((40, 180, 40), (230, 210, 40), (200, 200, 200))


def prompt_for(task: TaskSpec) -> str:
    options = "\n".join(
        f"{letter}. {answer}" for letter, answer in zip(LETTERS, task.answers, strict=True)
    )
    return f"<{task.modality}>\n{task.question}\n{options}\nAnswer with the letter."


# ----------------------------------------------------------------------------------------- media
def write_image(path: Path, answer: str, rng: np.random.Generator) -> dict[str, Any]:
    from PIL import Image

    base = np.array(COLOURS[answer], dtype=np.int16)
    jitter = rng.integers(-25, 26, size=3)
    img = np.empty((IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.int16)
    img[:] = base + jitter
    # Distractor blocks: never more than a third of the area, so "dominant" stays unambiguous.
    budget = IMAGE_SIZE * IMAGE_SIZE // 3
    for _ in range(int(rng.integers(0, 4))):
        h, w = (int(v) for v in rng.integers(6, 20, size=2))
        if h * w > budget:
            continue
        budget -= h * w
        y, x = (int(v) for v in rng.integers(0, IMAGE_SIZE - 20, size=2))
        img[y : y + h, x : x + w] = DISTRACTORS[int(rng.integers(len(DISTRACTORS)))]
    img += rng.integers(-12, 13, size=img.shape, dtype=np.int16)
    Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(path)
    return {"colour": answer}


def write_audio(path: Path, answer: str, rng: np.random.Generator) -> dict[str, Any]:
    import soundfile as sf

    freq = float(rng.uniform(200, 320) if answer == "low" else rng.uniform(2500, 3500))
    t = np.arange(int(AUDIO_SECONDS * AUDIO_SAMPLE_RATE)) / AUDIO_SAMPLE_RATE
    amp = float(rng.uniform(0.4, 0.6))
    wave = amp * np.sin(2 * np.pi * freq * t + rng.uniform(0, 2 * np.pi))
    wave += rng.normal(0, 0.01, size=wave.shape)
    sf.write(path, wave.astype(np.float32), AUDIO_SAMPLE_RATE, subtype="PCM_16")
    return {"freq_hz": round(freq, 1)}


def write_video(path: Path, answer: str, rng: np.random.Generator) -> dict[str, Any]:
    import av

    side = 20  # a full-height bar: its row carries no information, only its motion does
    start, end = 0, VIDEO_SIZE - side
    if answer == "left":
        start, end = end, start
    colour = np.array((240, 240, 240), dtype=np.uint8)
    background = rng.integers(0, 30, size=3).astype(np.uint8)
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=VIDEO_FPS)
        stream.width = stream.height = VIDEO_SIZE
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "18", "preset": "ultrafast"}
        for i in range(VIDEO_FRAMES):
            x = round(start + (end - start) * i / (VIDEO_FRAMES - 1))
            frame = np.empty((VIDEO_SIZE, VIDEO_SIZE, 3), dtype=np.uint8)
            frame[:] = background
            frame[:, x : x + side] = colour
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return {"direction": answer}


def write_video_with_sound(
    path: Path,
    frames: np.ndarray,
    fps: float,
    wave: np.ndarray,
    rate: int = AUDIO_SAMPLE_RATE,
    audio_codec: str = "aac",
) -> Path:
    """A video file whose sound track is ``wave`` (mono float in [-1, 1] at ``rate`` Hz), for
    audio-in-video rows (``use_audio_in_video``) and their tests: ``frames [T, H, W, 3]`` uint8
    at ``fps`` (H264), the track in ``audio_codec`` (``aac`` for mp4; ``pcm_s16le`` in mkv/mov
    keeps the samples exact up to 16-bit rounding)."""
    import av

    frames = np.asarray(frames, dtype=np.uint8)
    pcm = (np.clip(np.asarray(wave, np.float32), -1, 1) * 32767).round().astype(np.int16)
    with av.open(str(path), mode="w") as container:
        video = container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1000))
        video.height, video.width = frames.shape[1], frames.shape[2]
        video.pix_fmt = "yuv420p"
        video.options = {"crf": "18", "preset": "ultrafast"}
        audio = container.add_stream(audio_codec, rate=rate, layout="mono")
        for frame in frames:
            for packet in video.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        chunk = 1024  # aac's frame size; pcm takes any
        for at in range(0, pcm.size, chunk):
            part = pcm[None, at : at + chunk]
            frame = av.AudioFrame.from_ndarray(part, format="s16", layout="mono")
            frame.sample_rate, frame.pts = rate, at
            for packet in audio.encode(frame):
                container.mux(packet)
        for stream in (video, audio):
            for packet in stream.encode():
                container.mux(packet)
    return path


WRITERS: dict[str, Callable[[Path, str, np.random.Generator], dict[str, Any]]] = {
    "image": write_image,
    "audio": write_audio,
    "video": write_video,
}


# ---------------------------------------------------------------------------------------- dataset
def _rows(split: str, tasks: Sequence[str], n: int, root: Path, seed: int) -> list[dict[str, Any]]:
    """``n`` rows per task, classes balanced (alternating, then shuffled), media written under root."""
    rows: list[dict[str, Any]] = []
    for t_index, name in enumerate(tasks):
        task = TASKS[name]
        rng = np.random.default_rng([seed, t_index, 0 if split == "train" else 1])
        media_dir = root / split / name
        media_dir.mkdir(parents=True, exist_ok=True)
        for i in range(n):
            k = i % 2
            answer = task.answers[k]
            rel = Path(split) / name / f"{i:05d}.{task.suffix}"
            meta = WRITERS[name](root / rel, answer, rng)
            rows.append(
                {
                    "uid": f"{split}-{name}-{i:05d}",
                    "prompt": prompt_for(task),
                    "label": LETTERS[k],
                    "media": [{"type": name, "path": rel.as_posix()}],
                    "choices": list(task.answers),
                    "modality": name,  # no "reward": rewards.default / by_modality choose
                    "metadata": {"task": name, "answer": answer, **meta},
                }
            )
    random.Random(f"{seed}-{split}").shuffle(rows)
    return rows


def generate_synthetic(
    out_dir: str | os.PathLike[str],
    tasks: Sequence[str] = ("image", "audio", "video"),
    n_train: int = 256,
    n_eval: int = 64,
    seed: int = 0,
) -> tuple[Path, Path]:
    """Write ``train.jsonl``, ``eval.jsonl`` and their media under ``out_dir``; return both paths.

    ``n_train`` / ``n_eval`` are per task. Built in a temporary sibling and renamed at the end, so an
    interrupted generation never leaves a half-written dataset; an existing complete dataset with the
    same parameters is reused as is.
    """
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(
            f"unknown synthetic task(s) {unknown}; expected a subset of {sorted(TASKS)}"
        )
    if not tasks:
        raise ValueError("synthetic.tasks is empty; expected at least one of " + str(sorted(TASKS)))
    out = Path(out_dir)
    params = {
        "tasks": list(tasks),
        "n_train": n_train,
        "n_eval": n_eval,
        "seed": seed,
        "version": 3,
    }
    marker = out / "synthetic.json"
    if marker.is_file():
        if json.loads(marker.read_text()) == params:
            return out / "train.jsonl", out / "eval.jsonl"
        raise FileExistsError(
            f"{out} holds a synthetic dataset made with {marker.read_text().strip()}, not {params}; "
            "remove it or choose another directory"
        )
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists, is not empty and is not a synthetic dataset")
    with staged_dir(out) as tmp:
        for split, n in (("train", n_train), ("eval", n_eval)):
            rows = _rows(split, tasks, n, tmp, seed)
            with open(tmp / f"{split}.jsonl", "w") as f:
                for row in rows:
                    f.write(json.dumps(row) + "\n")
        (tmp / "synthetic.json").write_text(json.dumps(params))
    return out / "train.jsonl", out / "eval.jsonl"
