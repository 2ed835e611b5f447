"""The project's fake sglang-omni server as a process: what ``omni-grpo serve --kind fake`` runs.

Test-only. ``omni_rollout_client.testing.FakeOmniServer`` enforces the real 0.1.9 contract (its
routes, codes, weight versions, pause/continue) but lives in a test's own process; launched
through ``omni_grpo.serve`` — the code path that starts real sglang-omni servers — it becomes a
separate process the driver's Ray server actor owns, exactly like a real one.

Completions: by default the k-th request for a prompt is answered with the letter ``k % len(answers)``
of ``--answers`` (default ``ABCD``) and ``<|im_end|>``, so every group has right and wrong answers and
no completion ever holds a media marker token (the trainer's recompute would refuse one);
``--answers ''`` switches to the fake's hash generator (random token ids).

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
from typing import Any


def letter_answers(model_path: Path, letters: str) -> Any:
    """A generator answering the k-th request of a prompt with ``letters[k % len]`` + <|im_end|>."""
    import json

    from omni_rollout_client.testing import FakeGeneration, FakeRequest
    from transformers import AutoTokenizer

    config = json.loads((model_path / "config.json").read_text())
    im_end = int(config["im_end_token_id"])
    tok = AutoTokenizer.from_pretrained(str(model_path))
    answer_ids = [tok.encode(c, add_special_tokens=False) for c in letters]
    seen: dict[tuple[int, ...], int] = {}

    def generate(req: FakeRequest) -> FakeGeneration:
        key = tuple(req.input_ids)
        k = seen[key] = seen.get(key, -1) + 1
        ids = [*answer_ids[k % len(answer_ids)], im_end][: req.max_new_tokens]
        return FakeGeneration(token_ids=ids, logprobs=[-1.0] * len(ids))

    return generate


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="omni_grpo.testing.fake_server")
    parser.add_argument("--model-path", required=True, type=Path)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--token-delay-s", type=float, default=0.0)
    parser.add_argument("--receive-dir", type=Path, default=None)
    parser.add_argument("--answers", default="ABCD")
    args = parser.parse_args(argv)

    from omni_rollout_client.testing import FakeOmniServer

    server = FakeOmniServer.from_checkpoint(
        args.model_path,
        host=args.host,
        port=args.port,
        tp_size=args.tp_size,
        token_delay_s=args.token_delay_s,
        log_level="info",
        generator=letter_answers(args.model_path, args.answers) if args.answers else None,
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
