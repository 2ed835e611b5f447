"""Benchmark: streaming ``vl`` extraction vs a plain file copy vs a naive transformers round trip.

Alternating ``copy``, ``copy_in_process`` and ``vl`` extraction of a multi-GB hub checkpoint
(``checkpoints``), then once ``naive``: docs/benchmarks.md, "Methods".

    uv run python benchmarks/extract.py [--workdir /tmp/omni-extract-bench] [--layers 2]
"""

import shutil
from functools import partial

import checkpoints as ck
import harness

if __name__ == "__main__":
    args = harness.add_options(ck.options(__doc__, "extract"), skip_naive=False).parse_args()
    shard, work, src = args.shard_mb * 1000**2, args.workdir, args.workdir / "omni-src"
    if src.exists() and not (src / "config.json").exists():
        shutil.rmtree(src)
    make = partial(ck.generate_checkpoint, src, args.layers, shard)
    facts, gen_s = ck.generated(src / "bench_facts.json", make)
    sides = {"copy": ((), partial(ck.child, "copy", src))}
    sides["copy_in_process"] = ((), partial(ck.copy_shards, src))
    sides["vl"] = ((), lambda dst: ck.child("vl", src, dst, shard))
    runs = ck.rounds(work, args.repeats, sides)
    total, vl, copies = facts["total_bytes"], runs["vl"], runs["copy"]
    note = "GB/s over input bytes; timed inside the process, imports excluded"
    side = ck.measured(total, vl, note, output_bytes=vl[0]["bytes"], output_shards=vl[0]["shards"])
    rss = side["peak_rss_bytes"]
    budget = facts["largest_shard_bytes"] + side["largest_output_shard_bytes"]
    copy = "shutil.copyfile of the same shard files, same disk,"
    copy += " in a child with the vl child's imports"
    in_process = "the same copy inside this long-running process (no import pause before it)"
    times = [{k: round(r[k], 3) for k in ("seconds", "durable_seconds")} for r in copies]
    layout = "hub layout, released widths, fewer layers; shards cut through expert lists"
    checkpoint = {**facts, "generate_seconds": round(gen_s, 1), "dtype": "bfloat16", "note": layout}
    result = {"checkpoint": checkpoint, "copy": ck.gbps(total, copies, copy) | {"runs": times}}
    result |= {"vl_extract": side}
    result |= {"copy_in_process": ck.gbps(total, runs["copy_in_process"], in_process)}
    bases = {"vl_vs_in_process_copy": runs["copy_in_process"], "vl_vs_copy_throughput": copies}
    result |= ck.ratios(vl, **bases)
    result["peak_rss_vs_largest_input_plus_output_shard"] = round(rss / budget, 3)
    result["targets"] = {"vl_vs_copy_throughput": ">= 0.70", "peak_rss_ratio": "<= 1.2"}
    if not args.skip_naive:
        ndst = work / "naive"
        shutil.rmtree(ndst, ignore_errors=True)
        naive = ck.child("naive", src, ndst, shard)
        shutil.rmtree(ndst)
        method = "Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained + save_pretrained "
        method += "(same checkpoint; writes the thinker, not even the VL layout)"
        out = {"method": method, "seconds": round(naive["seconds"], 3)}
        out |= {"gbps": round(total / naive["seconds"] / 1e9, 3)}
        out |= {"peak_rss_bytes": naive["max_rss_bytes"]}
        result["naive"] = out | {"import_seconds": round(naive["import_seconds"], 2)}
        result["vl_speedup_vs_naive"] = round(naive["seconds"] / ck.best(vl)[0], 2)
        result["vl_rss_vs_naive"] = round(rss / naive["max_rss_bytes"], 3)
    ck.finish("extract", args, result)
