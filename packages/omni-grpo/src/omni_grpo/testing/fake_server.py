"""The project's fake sglang-omni server as a process: what ``omni-grpo serve --kind fake`` runs.

Test-only. ``omni_rollout_client.testing.FakeOmniServer`` enforces the real 0.1.9 contract (its
routes, codes, weight versions, pause/continue) but lives in a test's own process; launched
through ``omni_grpo.serve`` — the code path that starts real sglang-omni servers — it becomes a
separate process the driver's Ray server actor owns, exactly like a real one.

``--receive-dir`` also plays the thinker ranks' end of ``sync_mode: distributed``: receiver
processes join the weight-update group when the server accepts ``init_weights_update_group`` and
save every received bucket there (``omni_grpo.testing.sync.ServerSideReceivers``), so a test can
compare what arrived with the trainer's weights, bit for bit, over a real gloo group.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="omni_grpo.testing.fake_server")
    parser.add_argument("--model-path", required=True, type=Path)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--token-delay-s", type=float, default=0.0)
    parser.add_argument("--receive-dir", type=Path, default=None)
    args = parser.parse_args(argv)

    from omni_rollout_client.testing import FakeOmniServer

    server = FakeOmniServer.from_checkpoint(
        args.model_path,
        host=args.host,
        port=args.port,
        tp_size=args.tp_size,
        token_delay_s=args.token_delay_s,
        log_level="info",
    )
    server.start()
    receivers = None
    if args.receive_dir is not None:
        from omni_grpo.testing.sync import ServerSideReceivers

        receivers = ServerSideReceivers([server], args.receive_dir).__enter__()
    print(f"fake sglang-omni server at {server.url} (model {args.model_path})", flush=True)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    if receivers is not None:
        receivers.__exit__(None, None, None)
        for err in receivers.errors:
            print(f"receiver error: {err!r}", file=sys.stderr, flush=True)
    server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
