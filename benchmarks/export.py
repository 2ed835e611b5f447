"""Benchmark: ``omni-grpo export`` (omni format) vs a plain copy of the same bytes, same run, same disk.

The sides (``copy``, ``copy_in_process``, ``copy_same_ranges``: export's own overhead) and the
checkpoints (``checkpoints``): docs/benchmarks.md, "Methods"; the result: docs/export.md.

    uv run python benchmarks/export.py [--workdir /tmp/omni-export-bench] [--layers 2]
"""

import json
import shutil
from functools import partial
from pathlib import Path
from typing import Any

import checkpoints as ck


def make_run(run_dir: Path, base: Path, file_bytes: int) -> dict[str, Any]:
    """A run dir with config.yaml and a torch-backend checkpoint of the whole language model."""
    from omni_extract.expected import expected_thinker_tensors
    from omni_extract.names import match_hub
    from omni_extract.plan import FUSED_OF, FUSED_ROWS

    config = json.loads((base / "config.json").read_text())["thinker_config"]
    experts = int(config["text_config"]["num_experts"])
    trained: dict[str, tuple[int, ...]] = {}
    for hub, shape in expected_thinker_tensors(config).items():
        found = match_hub(hub)
        if found.row.fuse is not None:
            fused = FUSED_OF[found.row.fuse]
            name = FUSED_ROWS[fused].vl.format(layer=found.groups["layer"])  # type: ignore[union-attr]
            rows, cols = shape  # gate/up [I, H]; down [H, I] -> in memory [E, 2I, H] / [E, H, I]
            trained[name] = (experts, 2 * rows if fused == "gate_up" else rows, cols)
        elif found.row.key in ("lm", "lm_head"):
            trained[found.name_in("vl")] = shape  # type: ignore[index]
    ckpt = run_dir / "checkpoints" / "step_000001"
    ckpt.mkdir(parents=True)
    files = ck.write_shards(ckpt, trained, file_bytes, "model-rank{i:05d}.safetensors", 1, True)
    (ckpt / "state.json").write_text(json.dumps({"format": 1, "step": 1}))
    (run_dir / "config.yaml").write_text(f"model:\n  omni_checkpoint: {base}\n")
    out = {"trained_tensors": len(trained), "trained_files": len(set(files.values()))}
    return out | {"trained_bytes": sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))}


if __name__ == "__main__":
    args = ck.options(__doc__, "export").parse_args()
    work, shard = args.workdir, args.shard_mb * 1000**2
    base, run = work / "omni-base", work / "run"
    if not (run / "config.yaml").exists() or not (base / "bench_facts.json").exists():
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(run, ignore_errors=True)

    def make() -> dict[str, Any]:
        return ck.generate_checkpoint(base, args.layers, shard) | make_run(run, base, shard)

    facts, gen_s = ck.generated(base / "bench_facts.json", make)
    # each side: (the inputs read into the page cache first, run(dst))
    sides = {"copy": ((base,), partial(ck.child, "copy", base))}
    sides["copy_in_process"] = ((base,), partial(ck.copy_shards, base))
    sides |= {kind: ((run, base), partial(ck.child, kind, run)) for kind in ("ranges", "export")}
    runs = ck.rounds(work, args.repeats, sides)
    total, exp = facts["total_bytes"], runs["export"]
    note = "GB/s over output bytes; timed inside the process, imports excluded"
    first = {"tensors": exp[0]["tensors"], "replaced": exp[0]["replaced"]}
    side = ck.measured(total, exp, note, **first, output_bytes=exp[0]["bytes"])
    in_child = ", in a child with the export child's imports"
    copy = "shutil.copyfile of the base's shard files" + in_child
    same = "sendfile of exactly the byte ranges export moves (same source files, same order) "
    same += "into one file" + in_child
    in_process = "the same copy inside this long-running process"
    result = {"checkpoint": {**facts, "generate_seconds": round(gen_s, 1), "dtype": "bfloat16"}}
    result |= {"copy": ck.gbps(total, runs["copy"], copy)}
    result |= {"copy_in_process": ck.gbps(total, runs["copy_in_process"], in_process)}
    ranges = runs["ranges"][-1]["ranges"]
    result |= {"copy_same_ranges": ck.gbps(total, runs["ranges"], same, ranges=ranges)}
    bases = {"export_vs_same_ranges": runs["ranges"], "export_vs_copy_throughput": runs["copy"]}
    bases["export_vs_in_process_copy"] = runs["copy_in_process"]
    result |= {"export": side} | ck.ratios(exp, **bases)
    rss = side["peak_rss_bytes"] / side["largest_output_shard_bytes"]
    result["peak_rss_vs_largest_shard"] = round(rss, 3)
    targets = {"export_vs_copy_throughput": ">= 0.70", "peak_rss_vs_largest_shard": "<= 1.5"}
    result["targets"] = targets
    ck.finish("export", args, result)
