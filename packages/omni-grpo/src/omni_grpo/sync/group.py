"""The trainer's side of the weight-update process group, kept apart from its default group.

sglang (and therefore every sglang-omni thinker rank) joins the group with a helper that does, in
order: TCP rendezvous on ``tcp://master_address:master_port`` (the trainer, rank 0, hosts the
store), wrap the store in ``PrefixStore(group_name, store)``, then build the group with torch's
``_new_process_group_helper`` as if it were a default group (empty rank list), and register the
identity rank map. The store keys the backends exchange (NCCL unique id, gloo addresses) depend on
that exact prefixing, so the trainer must build its end the same way — a plain
``init_process_group`` would (a) use different key prefixes and (b) replace the trainer's own
default process group (its data/tensor-parallel world). This module does neither: it never
touches ``torch.distributed``'s default group, so a Megatron trainer keeps its world intact.

The store is created first on a free port (``port=0``) so the port can be sent to the servers
without a bind race; the group itself is built only once the servers have been asked to join
(their ``init_weights_update_group`` call blocks until every rank arrives).
"""

from __future__ import annotations

import inspect
import socket
from dataclasses import dataclass
from datetime import timedelta
from urllib.parse import urlsplit

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d


@dataclass
class WeightUpdateGroup:
    """A live weight-update group: the store that hosts it and the process group object."""

    group_name: str
    world_size: int
    rank: int
    backend: str
    store: dist.Store
    pg: dist.ProcessGroup

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> dist.Work | None:
        """Asynchronous broadcast of ``tensor`` from group rank ``src`` (0 is the trainer)."""
        return dist.broadcast(tensor, group=self.pg, group_src=src, async_op=True)

    def destroy(self) -> None:
        """Tear the group down (the servers destroy their side through the admin route)."""
        if self.pg is not None:
            dist.destroy_process_group(self.pg)
            self.pg = None  # type: ignore[assignment]


def reachable_address(server_url: str) -> str:
    """The local IP address the servers can reach the trainer at (the route to ``server_url``).

    A UDP ``connect`` sends nothing; it only asks the kernel which interface routes there.
    """
    host = urlsplit(server_url).hostname or "127.0.0.1"
    if host in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


def host_store(master_address: str, world_size: int, timeout_s: float) -> dist.TCPStore:
    """Start the rendezvous store as its master on a free port; read the port from ``.port``."""
    return dist.TCPStore(
        master_address,
        0,
        world_size,
        is_master=True,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def join_store(master_address: str, port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    """Connect to a store hosted by rank 0 (what a server rank does; used by test receivers)."""
    return dist.TCPStore(
        master_address,
        port,
        world_size,
        is_master=False,
        timeout=timedelta(seconds=timeout_s),
    )


def _c10d_new_group(
    prefixed: dist.PrefixStore, name: str, size: int, rank: int, backend: str, timeout: timedelta
) -> dist.ProcessGroup:
    """The one place that touches ``torch.distributed``'s private API, and why.

    sglang builds its end with ``c10d._new_process_group_helper`` (a group built as if it were a
    default group, on a ``PrefixStore``) and registers the identity rank map in
    ``c10d._world.pg_group_ranks``. The public ``new_group`` cannot do this: it carves subgroups out
    of the default group, which here would have to span trainer and servers. Our end must exchange
    the very same store keys, so it calls the same helper; when torch changes it (``pg_options``
    became ``backend_options``; sglang probes the same way), only this function has to follow.
    """
    helper = c10d._new_process_group_helper
    params = inspect.signature(helper).parameters
    options = "backend_options" if "backend_options" in params else "pg_options"
    pg, _ = helper(
        size, rank, [], backend, prefixed, group_name=name, timeout=timeout, **{options: None}
    )
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(size)}
    return pg


def build_group(
    store: dist.Store,
    *,
    group_name: str,
    world_size: int,
    rank: int,
    backend: str,
    timeout_s: float,
) -> WeightUpdateGroup:
    """Build the process group on ``store`` exactly as sglang's custom-group helper does.

    Blocks (gloo: in here; nccl: at the first collective) until all ``world_size`` ranks joined.
    """
    prefixed = dist.PrefixStore(group_name, store)
    timeout = timedelta(seconds=timeout_s)
    pg = _c10d_new_group(prefixed, group_name, world_size, rank, backend, timeout)
    return WeightUpdateGroup(group_name, world_size, rank, backend, store, pg)
