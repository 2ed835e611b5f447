"""The trainer's end of a distributed weight sync, driven from the Megatron export iterator.

``push_to_receiver`` is the NCCL data path of ``omni_grpo.sync.distributed`` (same group helper,
same bucketing, same server names through omni-extract's table, one broadcast per tensor in names
order) with the HTTP admin call replaced by a store key, so it can be measured and checked against
a local receiver process. Production runs use ``DistributedWeightSync`` with the same iterator.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

import torch

from omni_grpo.sync.base import ServerTensors
from omni_grpo.sync.buckets import buckets


def start_receiver(
    port: int, device: str, expected: str | None, rounds: int, group: str
) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        "-m",
        "omni_grpo.testing.megatron.receiver",
        "--port",
        str(port),
        "--device",
        device,
        "--rounds",
        str(rounds),
        "--group",
        group,
    ]
    if expected:
        cmd += ["--expected", expected]
    return subprocess.Popen(cmd)


def push_to_receiver(
    group: Any,
    store: Any,
    named_vl: Iterable[tuple[str, torch.Tensor]],
    round_: int,
    bucket_bytes: int,
    device: torch.device,
    max_in_flight: int = 2,
) -> dict[str, Any]:
    """Send the whole model once; returns sender-side figures and the receiver's verdict."""
    t0 = time.perf_counter()
    source = ServerTensors(named_vl, "vl_hub")
    n_buckets = 0
    in_flight: deque[tuple[list[Any], list[torch.Tensor]]] = deque()
    for i, bucket in enumerate(buckets(source, bucket_bytes)):
        store.set(
            f"r{round_}/bucket/{i}",
            json.dumps(
                {
                    "names": bucket.names,
                    "dtypes": bucket.dtypes,
                    "shapes": bucket.shapes,
                    "last": bucket.last,
                }
            ),
        )
        tensors = [t.to(device) for t in bucket.tensors]
        # keep the next bucket's export (gathers, renames) overlapping this bucket's broadcasts;
        # at most `max_in_flight` buckets are held, which bounds the extra memory
        in_flight.append(([group.broadcast(t) for t in tensors], tensors))
        while len(in_flight) > max_in_flight:
            for w in in_flight.popleft()[0]:
                w.wait()
        n_buckets += 1
    while in_flight:
        for w in in_flight.popleft()[0]:
            w.wait()
    ack = torch.zeros(1, device=device)
    group.broadcast(ack, src=1).wait()
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    verdict = json.loads(store.get(f"r{round_}/result"))
    return {
        "seconds": seconds,
        "bytes": source.bytes,
        "tensors": source.tensors,
        "buckets": n_buckets,
        "receiver": verdict,
    }


def raw_broadcast(group: Any, store: Any, nbytes: int, device: torch.device, round_: int) -> float:
    """Time one broadcast of ``nbytes`` in a single flat buffer (the baseline), receiver included."""
    store.set(
        f"r{round_}/bucket/0",
        json.dumps(
            {"names": ["raw"], "dtypes": ["bfloat16"], "shapes": [[nbytes // 2]], "last": True}
        ),
    )
    buf = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    group.broadcast(buf).wait()
    ack = torch.zeros(1, device=device)
    group.broadcast(ack, src=1).wait()
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    store.get(f"r{round_}/result")
    return seconds
