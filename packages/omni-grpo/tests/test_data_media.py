"""Media decoding (Pillow / soundfile / PyAV), 16 kHz resampling, frame sampling, root confinement,
and our patch processor against transformers' Qwen2VLImageProcessorPil."""

from __future__ import annotations

import os
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
import soundfile as sf
import torch
from omni_grpo.data.media import (
    MediaError,
    load_audio,
    load_image,
    load_video,
    resolve_media,
    sample_times,
)
from omni_grpo.data.vision import VisionProcessorConfig, process_frames, process_image, smart_resize
from PIL import Image


def write_tone(path: Path, freq: float, seconds: float, rate: int, channels: int = 1) -> None:
    t = np.arange(int(seconds * rate)) / rate
    wave = 0.5 * np.sin(2 * np.pi * freq * t)
    sf.write(path, np.stack([wave] * channels, axis=1) if channels > 1 else wave, rate)


def write_mp4(
    path: Path,
    n_frames: int,
    fps: int,
    size: int = 64,
    codec: str = "mpeg4",
    tone: float | None = None,
) -> None:
    """A square moving right, frame k has its left edge at x = 4k; optional sine audio track (aac)."""
    with av.open(str(path), "w") as out:
        vs = out.add_stream(codec, rate=fps)
        vs.width = vs.height = size
        vs.pix_fmt = "yuv420p"
        aus = None
        if tone is not None:
            aus = out.add_stream("aac", rate=16000)
            aus.layout = "mono"
        for k in range(n_frames):
            img = np.zeros((size, size, 3), np.uint8)
            img[24:40, 4 * k : 4 * k + 16] = 255
            for pkt in vs.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                out.mux(pkt)
        for pkt in vs.encode():
            out.mux(pkt)
        if aus is not None:
            n = int(16000 * n_frames / fps)
            wave = (0.5 * np.sin(2 * np.pi * tone * np.arange(n) / 16000)).astype(np.float32)
            frame = av.AudioFrame.from_ndarray(wave[None], format="flt", layout="mono")
            frame.sample_rate = 16000
            frame.pts = 0
            frame.time_base = Fraction(1, 16000)
            for pkt in aus.encode(frame):
                out.mux(pkt)
            for pkt in aus.encode():
                out.mux(pkt)


def dominant_freq(wave: np.ndarray, rate: int = 16000) -> float:
    spec = np.abs(np.fft.rfft(wave * np.hanning(wave.size)))
    return float(np.fft.rfftfreq(wave.size, 1 / rate)[spec.argmax()])


# ------------------------------------------------------------------------------------------- paths
def test_resolve_media_confines_to_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "a.wav").write_bytes(b"x")
    outside = tmp_path / "secret.wav"
    outside.write_bytes(b"x")
    os.symlink(outside, root / "link.wav")
    os.symlink(root / "sub" / "a.wav", root / "inner_link.wav")
    assert resolve_media(root, "sub/a.wav") == (root / "sub" / "a.wav").resolve()
    assert resolve_media(root, "sub/../sub/a.wav").name == "a.wav"
    assert (
        resolve_media(root, "inner_link.wav").name == "a.wav"
    )  # a symlink inside the root is fine
    for bad in ("../secret.wav", "link.wav", str(outside)):
        with pytest.raises(MediaError, match="outside the dataset root") as ei:
            resolve_media(root, bad)
        assert ei.value.reason == "escape"
    with pytest.raises(MediaError, match="not found") as ei:
        resolve_media(root, "sub/missing.wav")
    assert ei.value.reason == "missing"


# ------------------------------------------------------------------------------------------- audio
@pytest.mark.parametrize(("rate", "channels"), [(16000, 1), (44100, 2), (8000, 1)])
def test_wav_resampled_to_16k_mono(tmp_path: Path, rate: int, channels: int) -> None:
    p = tmp_path / "t.wav"
    write_tone(p, 440.0, 1.0, rate, channels)
    wave = load_audio(p)
    assert wave.dtype == np.float32 and wave.ndim == 1
    assert abs(wave.size - 16000) <= 64  # 1 s at 16 kHz (resampler edge effects only)
    assert dominant_freq(wave) == pytest.approx(440.0, abs=2.0)


def test_audio_truncated_and_from_mp3(tmp_path: Path) -> None:
    p = tmp_path / "t.wav"
    write_tone(p, 1000.0, 3.0, 22050)
    assert load_audio(p, max_seconds=1.5).size == pytest.approx(24000, abs=64)
    mp3 = tmp_path / "t.mp3"
    with av.open(str(mp3), "w") as out:
        st = out.add_stream("mp3", rate=44100)
        st.layout = "mono"
        wave = (0.5 * np.sin(2 * np.pi * 1000.0 * np.arange(44100) / 44100)).astype(np.float32)
        frame = av.AudioFrame.from_ndarray(wave[None], format="flt", layout="mono")
        frame.sample_rate = 44100
        for pkt in st.encode(frame):
            out.mux(pkt)
        for pkt in st.encode():
            out.mux(pkt)
    w = load_audio(mp3)
    assert w.size == pytest.approx(16000, rel=0.1)
    assert dominant_freq(w) == pytest.approx(1000.0, abs=5.0)


def test_audio_track_of_mp4(tmp_path: Path) -> None:
    p = tmp_path / "v.mp4"
    write_mp4(p, 16, 8, tone=600.0)
    w = load_audio(p)
    assert w.size == pytest.approx(32000, rel=0.1)
    assert dominant_freq(w) == pytest.approx(600.0, abs=5.0)


def test_unreadable_media(tmp_path: Path) -> None:
    for name, loader in (
        ("x.wav", load_audio),
        ("x.png", load_image),
        ("x.mp4", lambda p: load_video(p, 2.0, 8)),
    ):
        p = tmp_path / name
        p.write_bytes(b"not media at all")
        with pytest.raises(MediaError) as ei:
            loader(p)
        assert ei.value.reason == "unreadable" and name in str(ei.value)


# ------------------------------------------------------------------------------------------- video
def test_sample_times() -> None:
    np.testing.assert_allclose(sample_times(2.0, 2.0, 32), [0.0, 0.5, 1.0, 1.5])
    np.testing.assert_allclose(sample_times(10.0, 2.0, 4), [0.0, 2.5, 5.0, 7.5])  # capped: 0.4 fps


@pytest.mark.parametrize("codec", ["mpeg4", "libx264"])
def test_video_frames_at_fps(tmp_path: Path, codec: str) -> None:
    p = tmp_path / "v.mp4"
    write_mp4(p, 16, 8, codec=codec)  # 2 s at 8 fps; the square's x = 4 * frame index
    clip = load_video(p, fps=2.0, max_frames=32)
    assert clip.frames.shape == (4, 64, 64, 3) and clip.fps == pytest.approx(2.0)
    # frames at t = 0, .5, 1, 1.5 s are source frames 0, 4, 8, 12 -> square left edge 0, 16, 32, 48
    lefts = [int(np.argmax(f[32, :, 0] > 128)) for f in clip.frames]
    assert lefts == pytest.approx([0, 16, 32, 48], abs=1)
    capped = load_video(p, fps=8.0, max_frames=4)
    assert capped.frames.shape[0] == 4 and capped.fps == pytest.approx(2.0)


# ------------------------------------------------------------------------------------------ vision
def test_smart_resize_rules() -> None:
    assert smart_resize(224, 320, 32, 3136, 12845056) == (224, 320)
    assert smart_resize(10, 10, 32, 32 * 32 * 4, 10**7) == (64, 64)  # scaled up to min_pixels
    h, w = smart_resize(1000, 2000, 32, 1024, 64 * 64 * 32)
    assert h % 32 == 0 and w % 32 == 0 and h * w <= 64 * 64 * 32
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(1, 500, 32, 1024, 10**6)


@pytest.mark.parametrize(
    ("h", "w", "max_pixels"), [(224, 320, 12845056), (50, 70, 12845056), (300, 200, 64 * 64 * 4)]
)
def test_image_patches_match_transformers(h: int, w: int, max_pixels: int) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    rng = np.random.default_rng(h * w)
    img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    cfg = VisionProcessorConfig(max_pixels=max_pixels)
    ref = Qwen2VLImageProcessorPil(
        patch_size=16,
        temporal_patch_size=2,
        merge_size=2,
        image_mean=[0.5] * 3,
        image_std=[0.5] * 3,
        min_pixels=cfg.min_pixels,
        max_pixels=max_pixels,
    )(images=[img], return_tensors="pt")
    pv, grid = process_image(img, cfg)
    assert pv.shape[1] == 1536
    assert grid.tolist() == ref["image_grid_thw"][0].tolist()
    torch.testing.assert_close(pv, ref["pixel_values"].float(), atol=1e-5, rtol=0)


def test_video_patch_order() -> None:
    """Two identical frames give exactly the image rows (images are duplicated to the temporal
    patch); distinct frames land in the temporal slot of each row: row layout (C, tp, P, P)."""
    cfg = VisionProcessorConfig()
    rng = np.random.default_rng(0)
    f0 = rng.integers(0, 256, (64, 96, 3), dtype=np.uint8)
    f1 = rng.integers(0, 256, (64, 96, 3), dtype=np.uint8)
    img_pv, img_grid = process_image(f0, cfg)
    vid_pv, vid_grid = process_frames(np.stack([f0, f0]), cfg)
    torch.testing.assert_close(vid_pv, img_pv)
    assert vid_grid.tolist() == img_grid.tolist() == [1, 4, 6]
    pv, grid = process_frames(np.stack([f0, f1, f1]), cfg)  # 3 frames -> padded to 4 -> t = 2
    assert grid.tolist() == [2, 4, 6] and pv.shape == (2 * 4 * 6, 1536)
    rows = pv.view(2, 24, 3, 2, 16, 16)  # t, token, C, tp, P, P
    a, _ = process_image(f0, cfg)
    b, _ = process_image(f1, cfg)
    torch.testing.assert_close(rows[0, :, :, 0], a.view(24, 3, 2, 16, 16)[:, :, 0])
    torch.testing.assert_close(rows[0, :, :, 1], b.view(24, 3, 2, 16, 16)[:, :, 0])
    torch.testing.assert_close(rows[1], b.view(24, 3, 2, 16, 16))  # f1 and its repeat
    # first row = top-left 16x16 patch of channel 0 of the normalised frame
    top_left = (f0[:16, :16, 0].astype(np.float32) / 255 - 0.5) / 0.5
    torch.testing.assert_close(
        a.view(24, 3, 2, 16, 16)[0, 0, 0], torch.from_numpy(top_left), atol=1e-6, rtol=0
    )
    # second row = the patch to its right (inside the 2x2 merge window), third = the one below
    right = (f0[:16, 16:32, 0].astype(np.float32) / 255 - 0.5) / 0.5
    below = (f0[16:32, :16, 0].astype(np.float32) / 255 - 0.5) / 0.5
    torch.testing.assert_close(
        a.view(24, 3, 2, 16, 16)[1, 0, 0], torch.from_numpy(right), atol=1e-6, rtol=0
    )
    torch.testing.assert_close(
        a.view(24, 3, 2, 16, 16)[2, 0, 0], torch.from_numpy(below), atol=1e-6, rtol=0
    )


def test_processor_config_from_dir(tiny_omni_dir: Path) -> None:
    cfg = VisionProcessorConfig.from_dir(tiny_omni_dir)
    assert (cfg.patch_size, cfg.temporal_patch_size, cfg.merge_size) == (16, 2, 2)
    assert cfg.image_mean == (0.5, 0.5, 0.5)


# ------------------------------------------------------------------------------------------ limits
def png_claiming(width: int, height: int) -> bytes:
    """A valid 1x1 PNG whose header claims ``width`` x ``height`` (a decompression bomb's shape:
    Pillow refuses or accepts it from the header alone, before any pixel is decoded)."""
    import struct
    import zlib
    from io import BytesIO

    buf = BytesIO()
    Image.new("RGB", (1, 1)).save(buf, format="PNG")
    data = bytearray(buf.getvalue())
    ihdr = struct.pack(">II", width, height) + bytes(data[24:29])
    data[16:29] = ihdr
    data[29:33] = struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    return bytes(data)


@pytest.mark.parametrize(
    ("size", "limit"),
    [((5000, 5000), 20_000_000), ((20_000, 10_000), 64_000_000), ((1 << 20, 1 << 20), 64_000_000)],
)
def test_images_over_our_pixel_limit_refused(tmp_path: Path, size, limit: int) -> None:
    """Over our limit -> too_large, including sizes past Pillow's own bomb error (never its
    exception type, never its warning)."""
    p = tmp_path / "bomb.png"
    p.write_bytes(png_claiming(*size))
    for src in (p, p.read_bytes()):
        with pytest.raises(MediaError, match="over the limit|pixels") as ei:
            load_image(src, max_pixels=limit)
        assert ei.value.reason == "too_large"


@pytest.mark.parametrize("n", [0, 1, 160, 200])
def test_short_audio_refused_before_the_stft(tmp_path: Path, n: int) -> None:
    p = tmp_path / "short.wav"
    sf.write(p, np.full(n, 0.1, np.float32), 16000)
    with pytest.raises(MediaError) as ei:
        load_audio(p, min_samples=201)
    assert ei.value.reason in ({"empty"} if n == 0 else {"too_short"})
    assert load_audio(p, min_samples=1).size == n if n else True


def test_non_finite_audio_refused(tmp_path: Path) -> None:
    p = tmp_path / "nan.wav"
    wave = np.full(1600, 0.1, np.float32)
    wave[7] = np.nan
    sf.write(p, wave, 16000, subtype="FLOAT")
    with pytest.raises(MediaError, match="NaN") as ei:
        load_audio(p)
    assert ei.value.reason == "unreadable"


def test_video_over_pixel_limit_and_length_cap(tmp_path: Path) -> None:
    from omni_grpo.data.media import MediaLimits

    p = tmp_path / "v.mp4"
    write_mp4(p, 16, 8)  # 64x64, 2 s
    with pytest.raises(MediaError) as ei:
        load_video(p, 2.0, 8, limits=MediaLimits(max_source_pixels=64 * 63))
    assert ei.value.reason == "too_large"
    clip = load_video(p, 2.0, 32, limits=MediaLimits(video_max_seconds=1.0))
    assert clip.frames.shape[0] == 2  # only the first second is sampled


def test_bytes_decode_exactly_as_files(tmp_path: Path) -> None:
    """Embedded bytes go through the same decoders (chosen by content, not name) as files."""
    wav, mp3, png, mp4 = (tmp_path / n for n in ("t.wav", "t.mp3", "i.png", "v.mp4"))
    write_tone(wav, 440.0, 0.5, 22050)
    with av.open(str(mp3), "w") as out:
        st = out.add_stream("mp3", rate=44100)
        st.layout = "mono"
        w = (0.5 * np.sin(2 * np.pi * 700 * np.arange(22050) / 44100)).astype(np.float32)
        frame = av.AudioFrame.from_ndarray(w[None], format="flt", layout="mono")
        frame.sample_rate = 44100
        for pkt in [*st.encode(frame), *st.encode()]:
            out.mux(pkt)
    Image.fromarray(np.arange(48 * 40 * 3, dtype=np.uint8).reshape(48, 40, 3)).save(png)
    write_mp4(mp4, 16, 8)
    for f in (wav, mp3):
        np.testing.assert_array_equal(load_audio(f), load_audio(f.read_bytes()))
    np.testing.assert_array_equal(
        np.asarray(load_image(png)), np.asarray(load_image(png.read_bytes()))
    )
    a, b = load_video(mp4, 2.0, 8), load_video(mp4.read_bytes(), 2.0, 8)
    np.testing.assert_array_equal(a.frames, b.frames)
    assert a.fps == b.fps
    with pytest.raises(MediaError, match="embedded bytes") as ei:
        load_image(b"\x89PNG broken")
    assert ei.value.reason == "unreadable"
