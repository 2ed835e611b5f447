"""Test helpers for weight sync: the server side of the distributed protocol, and the reference.

``ServerSideReceivers`` plays what a sglang-omni thinker does on the other end of
``/update_weights_from_distributed``, in real separate processes: when a (fake) server records
an ``init_weights_update_group`` request, one receiver process per thinker TP rank joins the group
at ``rank_offset + tp_rank`` exactly as sglang's helper does (TCP rendezvous, ``PrefixStore``,
``_new_process_group_helper``); for every recorded update request it allocates
``torch.empty(shape, dtype)`` per name and receives the broadcasts from rank 0 in ``names``
order, then saves what it got to ``<out_dir>/rank<r>/bucket<k>.safetensors`` for the test to
compare bit-exactly. The fake server of ``omni_rollout_client.testing`` cannot host a torch
process group itself, so this relay reads its admin log (the requests it accepted) and forwards
them — the trainer under test talks to the fake server over real HTTP and to these receivers
over a real gloo (or NCCL) group.

``expected_server_tensors(hub_dir)`` computes, from a hub-layout Qwen3-Omni checkpoint and
independently of omni-extract's name table, what the server must end up holding: the hub names
of every thinker text/lm_head tensor, with per-expert weights fused into the Qwen3-VL hub layout
``gate_up_proj [E, H, 2I]`` / ``down_proj [E, I, H]``; no towers, no talker.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import re
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from omni_grpo.sync.group import build_group, join_store

_EXPERT = re.compile(
    r"(thinker\.model\.layers\.(\d+)\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight"
)


def read_hub_tensors(hub_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a (possibly sharded) safetensors checkpoint directory."""
    out: dict[str, torch.Tensor] = {}
    for file in sorted(Path(hub_dir).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                out[key] = f.get_tensor(key)
    return out


def expected_server_tensors(hub_dir: Path) -> dict[str, torch.Tensor]:
    """What the sglang-omni thinker must receive for this hub checkpoint (see module doc)."""
    hub = read_hub_tensors(hub_dir)
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = defaultdict(lambda: defaultdict(dict))
    for name, tensor in hub.items():
        m = _EXPERT.fullmatch(name)
        if m:
            experts[m.group(1)][m.group(4)][int(m.group(3))] = tensor
        elif name.startswith(("thinker.model.", "thinker.lm_head.")):
            out[name] = tensor
    for prefix, parts in experts.items():
        n = len(parts["gate"])
        gate_up = torch.stack([torch.cat([parts["gate"][e], parts["up"][e]], 0) for e in range(n)])
        down = torch.stack([parts["down"][e] for e in range(n)])
        out[f"{prefix}.gate_up_proj"] = gate_up.transpose(1, 2).contiguous()  # [E, H, 2I]
        out[f"{prefix}.down_proj"] = down.transpose(1, 2).contiguous()  # [E, I, H]
    return out


def receiver_main(
    inbox: Any,
    out_dir: str,
    rank: int,
    world: int,
    addr: str,
    port: int,
    group_name: str,
    backend: str,
    save: bool = True,
) -> None:
    store = join_store(addr, port, world, 120)
    group = build_group(
        store, group_name=group_name, world_size=world, rank=rank, backend=backend, timeout_s=120
    )
    # NCCL refuses two ranks on one GPU: receiver rank r takes GPU r (mod count); the trainer is
    # rank 0 on GPU 0.
    device = f"cuda:{rank % torch.cuda.device_count()}" if backend == "nccl" else "cpu"
    if backend == "nccl":
        torch.cuda.set_device(device)
    rank_dir = Path(out_dir) / f"rank{rank}"
    rank_dir.mkdir(parents=True, exist_ok=True)
    k = 0
    while True:
        msg = inbox.get()
        if msg is None:
            break
        names, dtypes, shapes = msg
        got: dict[str, torch.Tensor] = {}
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
            t = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
            group.broadcast(t, src=0).wait()
            got[name] = t.cpu() if save else t
        if not save:  # benchmarks: receive only, record that the bucket arrived
            (rank_dir / f"bucket{k:04d}.json").write_text(json.dumps({"names": names}))
            k += 1
            continue
        save_file(got, str(rank_dir / f"bucket{k:04d}.safetensors"))
        (rank_dir / f"bucket{k:04d}.json").write_text(
            json.dumps({"names": names, "dtypes": dtypes, "shapes": shapes})
        )
        k += 1
    group.destroy()


class ServerSideReceivers:
    """Watch fake servers' admin logs; run one receiver process per thinker TP rank (see module doc)."""

    def __init__(
        self, servers: list[Any], out_dir: Path, backend: str = "gloo", *, save: bool = True
    ) -> None:
        self.servers = servers
        self.save = save
        self.out_dir = Path(out_dir)
        self.backend = backend
        # forkserver: children fork from one server process that imported torch once (a fresh
        # interpreter per receiver pays the torch import each time), and never from this
        # multi-threaded test process (fork with live threads is unsafe).
        self._ctx = mp.get_context("forkserver")
        self._ctx.set_forkserver_preload(["torch", "omni_grpo.testing.sync"])
        self._procs: list[Any] = []
        self._inboxes: dict[int, list[Any]] = defaultdict(list)  # server index -> receiver queues
        self._group: dict[int, str] = {}
        self._seen = [0] * len(servers)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="receiver-relay", daemon=True)
        self.errors: list[BaseException] = []

    def __enter__(self) -> ServerSideReceivers:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        for queues in self._inboxes.values():
            for q in queues:
                q.put(None)
        for p in self._procs:
            p.join(30)
            if p.is_alive():
                p.kill()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                for i, server in enumerate(self.servers):
                    log = server.admin_log
                    for route, payload in log[self._seen[i] :]:
                        self._handle(i, server, route, payload)
                    self._seen[i] = len(log)
                time.sleep(0.005)
        except BaseException as exc:  # noqa: BLE001 - surfaced to the test through .errors
            self.errors.append(exc)

    def _handle(self, i: int, server: Any, route: str, payload: dict[str, Any]) -> None:
        if route == "/init_weights_update_group":
            tp = server.engine.tp_size
            self._group[i] = payload["group_name"]
            for q in self._inboxes.pop(i, []):
                q.put(None)
            for tp_rank in range(tp):
                inbox = self._ctx.Queue()
                proc = self._ctx.Process(
                    target=receiver_main,
                    args=(
                        inbox,
                        str(self.out_dir / payload["group_name"]),
                        payload["rank_offset"] + tp_rank,
                        payload["world_size"],
                        payload["master_address"],
                        payload["master_port"],
                        payload["group_name"],
                        payload.get("backend", self.backend),
                        self.save,
                    ),
                    daemon=True,
                )
                proc.start()
                self._procs.append(proc)
                self._inboxes[i].append(inbox)
        elif route == "/update_weights_from_distributed" and payload.get(
            "group_name"
        ) == self._group.get(i):
            for q in self._inboxes[i]:
                q.put((payload["names"], payload["dtypes"], payload["shapes"]))

    def received(
        self, group_name: str, buckets: slice = slice(None)
    ) -> dict[int, dict[str, torch.Tensor]]:
        """Per receiver rank: the tensors of the selected buckets (in receive order), by name.

        One push sends every name once, so select one push's buckets; a name received twice
        within the selection is an error.
        """
        out: dict[int, dict[str, torch.Tensor]] = {}
        for rank_dir in sorted((self.out_dir / group_name).glob("rank*")):
            rank = int(rank_dir.name[4:])
            got: dict[str, torch.Tensor] = {}
            for file in sorted(rank_dir.glob("bucket*.safetensors"))[buckets]:
                with safe_open(str(file), "pt") as f:
                    for key in f.keys():  # noqa: SIM118
                        if key in got:
                            raise AssertionError(f"rank {rank} received {key!r} twice")
                        got[key] = f.get_tensor(key)
            out[rank] = got
        return out

    def bucket_count(self, group_name: str, rank: int) -> int:
        return len(list((self.out_dir / group_name / f"rank{rank}").glob("bucket*.json")))
