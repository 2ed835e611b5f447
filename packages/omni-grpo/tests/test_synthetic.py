"""The synthetic perception dataset: real media files, valid rows, balanced labels, atomic writes."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from omni_grpo.data import read_samples
from omni_grpo.data.synthetic import TASKS, generate_synthetic


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return generate_synthetic(tmp_path_factory.mktemp("syn") / "data", n_train=6, n_eval=4, seed=3)


def test_rows_validate_and_are_balanced(dataset: tuple[Path, Path]) -> None:
    train, evaluation = dataset
    for path, n in ((train, 6), (evaluation, 4)):
        samples = read_samples(path)  # core's schema validation (placeholders match media, ...)
        assert len(samples) == 3 * n
        for task in TASKS:
            rows = [s for s in samples if s.modality == task]
            assert Counter(s.label for s in rows) == {"A": n // 2, "B": n // 2}
            # the text alone carries no information: one prompt per task
            assert len({s.prompt for s in rows}) == 1
            assert all(s.choices == list(TASKS[task].answers) for s in rows)
            assert all(
                TASKS[task].answers["AB".index(s.label)] == s.metadata["answer"] for s in rows
            )


def test_media_encode_the_label(dataset: tuple[Path, Path]) -> None:
    import av
    import soundfile as sf
    from PIL import Image

    train, _ = dataset
    root = train.parent
    for s in read_samples(train):
        path = root / s.media[0]["path"]
        answer = s.metadata["answer"]
        if s.modality == "image":
            img = np.asarray(Image.open(path).convert("RGB")).astype(float)
            red, blue = img[..., 0].mean(), img[..., 2].mean()
            assert (red > blue) == (answer == "red")
        elif s.modality == "audio":
            wave, sr = sf.read(path)
            assert sr == 16_000
            spectrum = np.abs(np.fft.rfft(wave))
            peak_hz = np.argmax(spectrum) * sr / len(wave)
            assert (peak_hz > 1000) == (answer == "high")
        else:
            with av.open(str(path)) as container:
                frames = [
                    f.to_ndarray(format="gray").astype(float) for f in container.decode(video=0)
                ]
            assert len(frames) >= 8

            def centre(frame: np.ndarray) -> float:
                cols = frame.mean(0)
                return float((cols * np.arange(len(cols))).sum() / cols.sum())

            moved = centre(frames[-1]) - centre(frames[0])
            assert (moved > 0) == (answer == "right")


def test_reuse_and_mismatch(dataset: tuple[Path, Path], tmp_path: Path) -> None:
    train, _ = dataset
    again = generate_synthetic(train.parent, n_train=6, n_eval=4, seed=3)
    assert again[0] == train
    with pytest.raises(FileExistsError, match="n_train"):
        generate_synthetic(train.parent, n_train=7, n_eval=4, seed=3)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("")
    with pytest.raises(FileExistsError, match="not empty"):
        generate_synthetic(tmp_path / "busy", n_train=2, n_eval=2)
    with pytest.raises(ValueError, match="unknown synthetic task"):
        generate_synthetic(tmp_path / "new", tasks=["smell"])


def test_interrupted_generation_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import omni_grpo.data.synthetic as syn

    def boom(*args: object) -> dict[str, object]:
        raise KeyboardInterrupt

    monkeypatch.setitem(syn.WRITERS, "video", boom)
    with pytest.raises(KeyboardInterrupt):
        syn.generate_synthetic(tmp_path / "data", n_train=2, n_eval=2)
    assert list(tmp_path.iterdir()) == []


def test_same_seed_same_bytes(tmp_path: Path) -> None:
    a, _ = generate_synthetic(tmp_path / "a", tasks=["image", "audio"], n_train=2, n_eval=2, seed=5)
    b, _ = generate_synthetic(tmp_path / "b", tasks=["image", "audio"], n_train=2, n_eval=2, seed=5)
    assert a.read_text() == b.read_text()
    for row in map(json.loads, a.read_text().splitlines()):
        rel = row["media"][0]["path"]
        assert (a.parent / rel).read_bytes() == (b.parent / rel).read_bytes()
