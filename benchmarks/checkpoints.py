"""What ``extract.py`` and ``export.py`` share: a generated hub checkpoint at the released widths,
the measured sides as children (``python benchmarks/checkpoints.py KIND SRC DST [SHARD]``, one
prelude for all: imports done and timed apart before any clock starts), and the alternating
rounds that time them, to the page cache and until ``os.sync()`` returns. Why each choice:
docs/benchmarks.md, "Methods".
"""

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import harness
import torch
from released import AUDIO, ROPE, TEXT, VISION, VOCAB
from safetensors.torch import save_file

Side = tuple[tuple[Path, ...], Callable[[Path], dict[str, Any]]]


def write_shards(
    dst: Path, shapes: dict, limit: int, name: str, seed: int, over: bool, meta: Any = None
) -> dict[str, str]:
    """``shapes`` as bf16 files ``dst/name.format(i=, n=)`` of ~``limit`` bytes (``over``: at least
    that), bytes tiled from one random draw; returns tensor name -> file name."""
    noise = torch.randn(1 << 22, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    files: list[list[str]] = [[]]
    size = 0
    for tensor, shape in shapes.items():
        n = 2 * math.prod(shape)
        if files[-1] and (size >= limit if over else size + n > limit):
            files, size = [*files, []], 0
        files[-1].append(tensor)
        size += n
    where: dict[str, str] = {}
    for i, names in enumerate(files, start=1):
        fname = name.format(i=i, n=len(files))
        tiled = {k: noise.repeat(-(-math.prod(shapes[k]) // noise.numel())) for k in names}
        tiled = {k: t[: math.prod(shapes[k])].reshape(shapes[k]) for k, t in tiled.items()}
        save_file(tiled, dst / fname, meta)
        where |= dict.fromkeys(names, fname)
    return where


def generate_checkpoint(dst: Path, layers: int, shard_bytes: int) -> dict[str, Any]:
    """A hub-layout bf16 checkpoint at the released widths, shards cut through expert lists."""
    from omni_extract import tiny
    from omni_extract.expected import expected_thinker_tensors
    from omni_extract.tokens import REAL_IDS

    rope = {"rope_type": "default", **ROPE, "interleaved": True}
    text = {**TEXT, "num_hidden_layers": layers, "rope_parameters": rope}
    vision = {**VISION, "depth": 2, "deepstack_visual_indexes": [0, 1]}
    audio = {**AUDIO, "encoder_layers": 2}
    spec = tiny.TinyOmniSpec(text=text, vision=vision, audio=audio, dtype="bfloat16")
    config = tiny.build_config(spec, dict(REAL_IDS), VOCAB).to_dict()
    config["dtype"] = "bfloat16"
    shapes = expected_thinker_tensors(config["thinker_config"])
    shapes["talker.model.norm.weight"] = (1024,)  # dropped by every variant, as on the hub
    dst.mkdir(parents=True)
    shard = "model-{i:05d}-of-{n:05d}.safetensors"
    weight_map = write_shards(dst, shapes, shard_bytes, shard, 0, False, {"format": "pt"})
    tiny.build_small_tokenizer().save_pretrained(dst)  # the tokenizer's size is irrelevant here
    files = {"model.safetensors.index.json": {"metadata": {}, "weight_map": weight_map}}
    files |= {"config.json": config, **tiny.processor_artifacts(spec.vision)}
    for name, payload in files.items():
        (dst / name).write_text(json.dumps(payload, indent=2 if name == "config.json" else None))
    sizes = [f.stat().st_size for f in dst.glob("model-*.safetensors")]
    out = {"layers": layers, "tensors": len(shapes), "shards": len(sizes)}
    return out | {"total_bytes": sum(sizes), "largest_shard_bytes": max(sizes)}


def copy_shards(src: Path, dst: Path) -> dict[str, float]:
    """``shutil.copyfile`` of the shards: the limit of any rewrite of these bytes on this disk."""
    files = sorted(src.glob("model-*.safetensors"))
    dst.mkdir(parents=True)
    with harness.timed() as t:
        for f in files:
            shutil.copyfile(f, dst / f.name)
    return {"seconds": t.s}


def child(kind: str, *args: str | Path) -> dict[str, Any]:
    """Run side ``kind`` of :func:`_child_main` in its own process; its JSON record."""
    return harness.child_json([sys.executable, __file__, kind, *map(str, args)])


def rounds(work: Path, repeats: int, sides: dict[str, Side]) -> dict[str, list[dict[str, Any]]]:
    """``repeats`` rounds of every side in turn: (dirs read into the page cache first, run(dst))."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in sides}
    for i in range(repeats):
        for name, (warm, run) in sides.items():
            dst = work / f"{name}-{i}"
            shutil.rmtree(dst, ignore_errors=True)
            os.sync()
            # every input read once, untimed: when the page cache cannot hold inputs and outputs,
            # the side that ran after the other's multi-GB writes read cold (it measured eviction)
            for f in [f for d in warm for f in sorted(d.rglob("*.safetensors"))]:
                with open(f, "rb") as fh:
                    while fh.read(1 << 24):
                        pass
            r = run(dst)
            with harness.timed() as sync:  # what is still dirty, written
                os.sync()
            runs[name].append({**r, "durable_seconds": r["seconds"] + sync.s})
            shutil.rmtree(dst)
    return runs


def best(runs: list[dict[str, Any]]) -> tuple[float, float]:
    """The least disturbed (cached, durable) seconds."""
    return min(r["seconds"] for r in runs), min(r["durable_seconds"] for r in runs)


def gbps(total: int, runs: list[dict[str, Any]], method: str = "", **facts: Any) -> dict[str, Any]:
    """A side's best GB/s (cached, durable), after its ``method`` and ``facts`` when given."""
    cached, durable = best(runs)
    gb = {"cached_gbps": round(total / cached / 1e9, 3)}
    gb["durable_gbps"] = round(total / durable / 1e9, 3)
    return ({"method": method} if method else {}) | facts | gb


def ratios(runs: list[dict[str, Any]], **bases: list[dict[str, Any]]) -> dict[str, float]:
    """Per base ``<name>_cached`` / ``_durable``: ``runs``' throughput over the base's (best of each)."""
    (ours, ours_d), out = best(runs), {}
    for name, base in bases.items():
        theirs, theirs_d = best(base)
        out[f"{name}_cached"] = round(theirs / ours, 3)
        out[f"{name}_durable"] = round(theirs_d / ours_d, 3)
    return out


def measured(total: int, runs: list[dict[str, Any]], note: str, **facts: Any) -> dict[str, Any]:
    """The measured side's section: GB/s, each run's times, ``facts``, output and peak RSS."""
    times = ("seconds", "durable_seconds", "import_seconds")
    out = gbps(total, runs) | {"runs": [{k: round(r[k], 3) for k in times} for r in runs], **facts}
    out["largest_output_shard_bytes"] = runs[-1]["largest_output_shard_bytes"]
    return out | {"peak_rss_bytes": max(r["max_rss_bytes"] for r in runs), "note": note}


def options(doc: str | None, name: str) -> argparse.ArgumentParser:
    """``--layers``: MoE layers, ~1.2 GB of experts each; ``--keep``: keep ``--workdir``."""
    work = Path(tempfile.gettempdir()) / f"omni-{name}-bench"
    return harness.parser(doc, workdir=work, layers=2, shard_mb=1000, repeats=3, keep=False)


def generated(facts: Path, make: Callable[[], dict[str, Any]]) -> tuple[dict[str, Any], float]:
    """``make()``'s size facts and seconds, or those of an earlier run kept in ``facts``."""
    with harness.timed() as t:
        if not facts.exists():
            facts.write_text(json.dumps(make()))
    return json.loads(facts.read_text()), t.s


def finish(name: str, args: argparse.Namespace, result: dict[str, Any]) -> None:
    """The machine added; ``--workdir`` deleted (unless ``--keep``); the record emitted."""
    result["machine"] = {"cpus": os.cpu_count(), "load_avg_1min_at_end": os.getloadavg()[0]}
    if not args.keep:
        shutil.rmtree(args.workdir)
    harness.emit(name, result, args.save)


# --------------------------------------------------------------------------------- the children
def _child_main(kind: str, src: str, dst: str, shard: str = "0") -> dict[str, Any]:
    """One side, timed inside this process after the shared prelude (imports timed apart)."""
    with harness.timed() as imports:
        from omni_extract import extract
        from omni_extract.export import build_export_plan
        from omni_extract.source import open_source
        from omni_grpo.export import export_run
        from omni_grpo.export.run import default_base, find_checkpoint, open_trained
        from transformers import Qwen3OmniMoeThinkerForConditionalGeneration as Thinker
    out: dict[str, Any] = {"import_seconds": imports.s}
    if kind == "copy":
        return out | copy_shards(Path(src), Path(dst))
    ranges = []  # "ranges": every (file, offset, length) export_run(src) moves, planned untimed
    if kind == "ranges":
        source = open_source(default_base(Path(src)))
        trained = open_trained(find_checkpoint(Path(src), None).files, source)
        for t in build_export_plan(source, trained).tensors:
            if t.base is not None:
                where = t.base.source
                ranges.append((str(source.root / where.file), where.offset, where.nbytes))
            else:
                part = t.part and trained.hub_expert(t.trained, t.expert, t.part)
                p = part or trained.tensor(t.trained)
                ranges.append((str(p.path), p.offset, p.nbytes))
        Path(dst).mkdir(parents=True)
    with harness.timed() as t:
        if kind == "vl":
            r = extract(src, dst, variant="vl", shard_size=int(shard))
            out |= {"bytes": r.num_bytes, "shards": len(r.shards)}
        elif kind == "export":
            r, _ = export_run(src, dst)
            out |= {"bytes": r.num_bytes, "replaced": r.num_replaced, "tensors": r.num_tensors}
        elif kind == "naive":
            model = Thinker.from_pretrained(src, dtype=torch.bfloat16)
            model.save_pretrained(dst, max_shard_size=int(shard))
        else:  # the same bytes, literally: the ranges sendfile'd into one file by a plain loop
            into = os.open(Path(dst) / "all.bin", os.O_WRONLY | os.O_CREAT, 0o644)
            for path, offset, n in ranges:
                fd = os.open(path, os.O_RDONLY)
                while n:
                    sent = os.sendfile(into, fd, offset, n)
                    offset, n = offset + sent, n - sent
                os.close(fd)
            os.close(into)
            out["ranges"] = len(ranges)
    shards = [f.stat().st_size for f in Path(dst).glob("*.safetensors")]
    out |= {"largest_output_shard_bytes": max(shards, default=0)}
    return out | {"seconds": t.s, "max_rss_bytes": harness.status_kb("VmHWM") * 1024}


if __name__ == "__main__":
    harness.reply(_child_main(*sys.argv[1:]))
