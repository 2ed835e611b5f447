"""Rows through the parquet path vs jsonl + media files, and RSS while streaming a big parquet.

Every synthetic perception row through ``OmniDataset.load`` from both sources, and a parquet of
more than ``--stream-gb`` GB streamed in a child against other layouts: docs/benchmarks.md.

    uv run python benchmarks/data_sources.py [--rows-per-task 40] [--stream-gb 2.2] [--tmp DIR]
"""

import io
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import harness
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import soundfile as sf
from omni_extract.tiny import TinyOmniSpec, make_tiny_omni
from omni_grpo.config import DataConfig
from omni_grpo.data import tables
from omni_grpo.data.dataset import OmniDataset
from omni_grpo.data.media import resolve_media
from omni_grpo.data.prompt import PromptBuilder
from omni_grpo.data.sources import read_samples
from omni_grpo.data.synthetic import generate_synthetic
from PIL import Image

IMAGE_SIDE = 1024  # 3 MiB of BMP per streamed row
AUDIO_SECONDS = 20.0  # 625 KiB of 16-bit WAV per streamed row
PROMPT = "<image>\nWhich colour?\nA. red\nB. blue\n<audio>\nHigh or low?"


def dataset(spec: Path, root: Path | None, model_dir: Path) -> Any:
    return OmniDataset(spec, root, PromptBuilder(model_dir, DataConfig()))


def throughput(tmp: Path, model_dir: Path, rows_per_task: int, repeats: int) -> dict[str, Any]:
    train, _ = generate_synthetic(tmp / "files", ("image", "audio", "video"), rows_per_task, 1, 0)
    tables.write_embedded_parquet(read_samples(train), train.parent, tmp / "rows.parquet")
    sources = {"jsonl": dataset(train, train.parent, model_dir)}
    sources["parquet"] = dataset(tmp / "rows.parquet", None, model_dir)
    n = len(sources["jsonl"])
    orders = {"file_order": range(n), "shuffled": np.random.default_rng(0).permutation(n)}
    for ds in sources.values():  # warm-up: page cache, lazily built extractors
        for i in range(n):
            ds.load(i)
    best: dict[str, dict[str, float]] = {o: {} for o in orders}
    for rep in range(repeats):
        for order_name, order in orders.items():
            # alternate which source goes first: a drift in the load must not favour one
            for name in list(sources)[:: 1 if rep % 2 == 0 else -1]:
                with harness.timed() as t:
                    for i in order:
                        assert sources[name].load(int(i)) is not None
                best[order_name][name] = max(best[order_name].get(name, 0.0), n / t.s)
    pairs = [(sources["jsonl"].load(i), sources["parquet"].load(i)) for i in range(n)]
    same = [a.input_ids == b.input_ids and a.mm.keys() == b.mm.keys() for a, b in pairs]
    identical = all(same) and all(bool((a.mm[k] == b.mm[k]).all()) for a, b in pairs for k in a.mm)
    out = {"rows": n, "identical_inputs": identical}
    # an item's bytes (resolve + read the file, vs fetch from the parquet row group; decoding
    # after it is the same code): microseconds per item, best of repeats * 5 passes
    files, table = sources["jsonl"], sources["parquet"]
    file_items = [m for s in files.samples for m in s.media]
    table_items = [m for s in table.samples for m in s.media]
    fastest = {"file": float("inf"), "parquet": float("inf")}
    for _ in range(repeats * 5):
        with harness.timed() as t:
            for m in file_items:
                resolve_media(files.root, m["path"]).read_bytes()
        fastest["file"] = min(fastest["file"], t.s / len(file_items))
        with harness.timed() as t:
            for m in table_items:
                table.loaded.fetch(m)
        fastest["parquet"] = min(fastest["parquet"], t.s / len(table_items))
    us = {"file_resolve_read_us": fastest["file"], "parquet_fetch_us": fastest["parquet"]}
    speed = {"ratio_speed_parquet_vs_file": round(fastest["file"] / fastest["parquet"], 3)}
    out["media_access"] = {k: round(v * 1e6, 1) for k, v in us.items()} | speed
    for order, r in best.items():
        out[order] = {f"{k}_rows_per_s": round(r[k], 2) for k in ("jsonl", "parquet")}
        out[order]["ratio_parquet_vs_jsonl"] = round(r["parquet"] / r["jsonl"], 3)
    return out


def write_stream_data(tmp: Path, gb: float) -> tuple[Path, Path, int]:
    """A parquet of more than ``gb`` GB of embedded media, and the same rows as jsonl + files."""
    schema, files = tables.embedded_schema(), tmp / "stream_files"
    files.mkdir()
    parquet, jsonl = tmp / "stream.parquet", files / "rows.jsonl"
    n_rows = int(gb * 1e9 / (IMAGE_SIDE**2 * 3 + int(AUDIO_SECONDS * 16000) * 2)) + 1
    with (
        pq.ParquetWriter(str(parquet), schema, **tables.writer_options()) as writer,
        jsonl.open("w") as jf,
    ):
        batch: list[dict[str, Any]] = []
        size, rng, t = 0, np.random.default_rng(1), np.arange(int(AUDIO_SECONDS * 16000)) / 16000
        for k in range(n_rows):  # unique noise images (BMP: no encode cost) and tones
            ib, ab = io.BytesIO(), io.BytesIO()
            img = rng.integers(0, 256, (IMAGE_SIDE, IMAGE_SIDE, 3), dtype=np.uint8)
            Image.fromarray(img).save(ib, format="BMP")
            wave = 0.3 * np.sin(2 * np.pi * (200 + k % 50 * 40) * t)
            wave = (wave + 0.01 * rng.standard_normal(t.size)).astype(np.float32)
            sf.write(ab, wave, 16000, format="WAV", subtype="PCM_16")
            img, wav = ib.getvalue(), ab.getvalue()
            (files / f"{k}.bmp").write_bytes(img)
            (files / f"{k}.wav").write_bytes(wav)
            row = {"id": f"s{k}", "prompt": PROMPT, "label": "A", "choices": ["x", "y"]}
            media = [{"type": "image", "path": f"{k}.bmp"}, {"type": "audio", "path": f"{k}.wav"}]
            jf.write(json.dumps({**row, "media": media}) + "\n")
            row |= {"reward": "mcq", "modality": "mixed", "metadata": "{}", "videos": []}
            row["images"] = [{"bytes": img, "path": f"{k}.bmp"}]
            row["audios"] = [{"bytes": wav, "path": f"{k}.wav"}]
            batch.append(row)
            size += len(img) + len(wav)
            if size >= tables.EMBED_ROW_GROUP_BYTES:
                writer.write_table(pa.Table.from_pylist(batch, schema))
                batch, size = [], 0
        if batch:
            writer.write_table(pa.Table.from_pylist(batch, schema))
    return parquet, jsonl, n_rows


def child_stream(spec: str, model_dir: str, limit: int) -> dict[str, Any]:
    """(the child) Stream ``limit`` rows of ``spec`` (0: all); its memory figures."""
    path = Path(spec)
    ds = dataset(path, path if path.is_dir() else path.parent, Path(model_dir))
    mb = {"rss_after_open_mb": harness.status_kb("VmRSS"), "peak_rss_anon_mb": 0}
    mb["peak_rss_file_mb"], n = 0, min(limit, len(ds)) if limit > 0 else len(ds)
    with harness.timed() as t:
        for i in range(n):
            assert ds.load(i) is not None
            mb["peak_rss_anon_mb"] = max(mb["peak_rss_anon_mb"], harness.status_kb("RssAnon"))
            mb["peak_rss_file_mb"] = max(mb["peak_rss_file_mb"], harness.status_kb("RssFile"))
    mb["peak_rss_mb"] = harness.status_kb("VmHWM")
    out = {"rows": n, "rows_per_s": round(n / t.s, 2)}
    return out | {k: round(v / 1024, 1) for k, v in mb.items()}


def stream(spec: Path, model_dir: Path, limit: int = 0) -> dict[str, Any]:
    """:func:`child_stream` in a child, ``spec`` evicted from the page cache: every source cold."""
    folder = spec if spec.is_dir() or spec.suffix == ".parquet" else spec.parent
    for f in [folder] if folder.is_file() else [p for p in folder.rglob("*") if p.is_file()]:
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
            os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return harness.rerun(json.dumps([str(spec), str(model_dir), limit]))


if __name__ == "__main__":
    ap = harness.parser(__doc__, rows_per_task=40, repeats=5, stream_gb=2.2, tmp=Path)
    args = ap.parse_args()
    harness.torch_threads(1)
    if args.side is not None:  # a child: child_stream(spec, model_dir, limit)
        harness.reply(child_stream(*json.loads(args.side)))
    if args.tmp is not None:  # e.g. --tmp /tmp/bench on a fresh machine: make it, as -p would
        args.tmp.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="omni-grpo-data-bench-", dir=args.tmp))
    try:
        model_dir = make_tiny_omni(tmp / "omni", TinyOmniSpec())
        result = {"throughput": throughput(tmp, model_dir, args.rows_per_task, args.repeats)}
        parquet, jsonl, n_rows = write_stream_data(tmp, args.stream_gb)
        full, part = stream(parquet, model_dir), stream(parquet, model_dir, max(1, n_rows // 10))
        files = stream(jsonl, model_dir)
        # the parquet's rows as a save_to_disk layout: one Arrow IPC stream + state.json
        f, arrow_dir = pq.ParquetFile(str(parquet)), tmp / "stream_arrow"
        data = arrow_dir / "data-00000-of-00001.arrow"
        arrow_dir.mkdir()
        with pa.OSFile(str(data), "wb") as sink, pa.ipc.new_stream(sink, f.schema_arrow) as w:
            for rg in range(f.num_row_groups):
                w.write_table(f.read_row_group(rg))
        state = {"_data_files": [{"filename": data.name}]}
        (arrow_dir / "state.json").write_text(json.dumps(state))
        arrow = stream(arrow_dir, model_dir)

        def ratio(a: dict, b: dict, key: str = "peak_rss_mb") -> float:
            return round(a[key] / b[key], 3)

        out = {"parquet_gb": round(parquet.stat().st_size / 1e9, 3), "rows": n_rows}
        out |= {"parquet_full": full, "parquet_first_tenth": part, "jsonl_files_full": files}
        out |= {"save_to_disk_full": arrow, "rss_growth_ratio_full_vs_tenth": ratio(full, part)}
        out |= {"rss_ratio_parquet_vs_files": ratio(full, files)}
        out |= {"rss_ratio_save_to_disk_vs_files": ratio(arrow, files)}
        rate = "stream_rows_per_s_ratio_{}_vs_files".format
        out[rate("save_to_disk")] = ratio(arrow, files, "rows_per_s")
        result["stream"] = out | {rate("parquet"): ratio(full, files, "rows_per_s")}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    harness.emit("data_sources", result, args.save)
