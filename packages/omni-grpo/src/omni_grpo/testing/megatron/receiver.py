"""A stand-in for one sglang-omni thinker rank on the receiving end of a distributed weight sync.

It joins the weight-update group exactly as the server does (``omni_grpo.sync.group``), reads each
bucket's ``{names, dtypes, shapes}`` — the body of ``/update_weights_from_distributed`` — from the
rendezvous store (the HTTP admin call in production), receives one broadcast per tensor in names
order, and either checks every tensor bit-exactly against an expected safetensors file or only
counts bytes (bandwidth runs). Used by the GPU verification and the benchmark; it is a process
boundary, so it lives in its own process.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def main(argv: list[str] | None = None) -> int:
    from safetensors.torch import load_file

    from omni_grpo.sync.group import build_group, join_store

    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--device", default="cuda:1")
    ap.add_argument(
        "--expected", default=None, help="safetensors file of server-named tensors to compare with"
    )
    ap.add_argument("--group", default="omni_grpo_weights_test")
    ap.add_argument("--rounds", type=int, default=1)
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    torch.cuda.set_device(device)
    store = join_store("127.0.0.1", a.port, 2, 600)
    group = build_group(
        store, group_name=a.group, world_size=2, rank=1, backend="nccl", timeout_s=600
    )
    for rnd in range(a.rounds):
        expected = None
        seen, bad, nbytes, i = [], [], 0, 0
        while True:
            meta = json.loads(store.get(f"r{rnd}/bucket/{i}"))
            if i == 0 and a.expected:  # the sender writes the file before posting its first bucket
                expected = load_file(a.expected.format(round=rnd))
            bufs = [
                torch.empty(s, dtype=_DTYPES[d], device=device)
                for s, d in zip(meta["shapes"], meta["dtypes"], strict=True)
            ]
            works = [group.broadcast(b) for b in bufs]
            for w in works:
                w.wait()
            for name, buf in zip(meta["names"], bufs, strict=True):
                nbytes += buf.numel() * buf.element_size()
                seen.append(name)
                if expected is not None:
                    ref = expected.get(name)
                    if (
                        ref is None
                        or ref.shape != buf.shape
                        or ref.dtype != buf.dtype
                        or not torch.equal(ref.to(device), buf)
                    ):
                        bad.append(name)
            i += 1
            if meta["last"]:
                break
        torch.cuda.synchronize(device)
        missing = sorted(set(expected) - set(seen)) if expected is not None else []
        result = {
            "round": rnd,
            "tensors": len(seen),
            "bytes": nbytes,
            "buckets": i,
            "mismatched": bad[:20],
            "n_mismatched": len(bad),
            "missing": missing[:20],
            "n_missing": len(missing),
        }
        store.set(f"r{rnd}/result", json.dumps(result))
        # ack through the group too, so the sender can time "every byte landed"
        ack = torch.ones(1, device=device)
        group.broadcast(ack, src=1).wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
