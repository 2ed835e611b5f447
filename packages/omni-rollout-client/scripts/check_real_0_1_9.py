"""omni-rollout-client's whole server contract against the REAL sglang-omni 0.1.9 HTTP layer.

Runs every case of ``omni_rollout_client.testing.contract_cases`` (the same cases CI runs against
the package's fake server, ``tests/test_contract_cases.py``) against sglang-omni 0.1.9 code:

* real: ``create_app`` (routes, pydantic validation, status mapping, auth, ``model_info``'s 409),
  ``Client`` and ``Coordinator`` (``timeout_s`` -> ``wait_for``, admission cap, abort handling,
  admin aggregation), the Qwen3-Omni preprocessor's ``call_impl`` (bundle decoding, context
  limit), the thinker's ``build_sglang_thinker_request`` (sglang ``SamplingParams`` normalise /
  verify, vocabulary check), ``apply_thinker_result`` and the decode stage's
  ``build_decode_result``, the stage shell's ``run_admin_operation`` and the scheduler's admin
  code (``OmniScheduler.admin`` queueing and ``run_weight_update_with_lifecycle``: pause modes,
  active-request refusal, keep-pause-on-failure) and ``ModelWorker``'s weight-update wrappers;
* fake: the model. A scheduler thread "decodes" one token per step from the package's
  deterministic hash generator (the fake server's), and the model runner's load / NCCL calls
  succeed or fail without touching a GPU. Stages talk in-process instead of over ZMQ.

Prints one PASS/FAIL line per case and one JSON summary line. Needs a throwaway venv (NOT the
workspace's uv.lock; sglang-omni pins CUDA-13 wheels that do not resolve on a CPU box, so its
pure-Python dependencies are installed by hand, ~2 GB with torch):

    uv venv /tmp/sgl --python 3.11
    uv pip install --python /tmp/sgl --no-deps sglang-omni==0.1.9 sglang==0.5.22
    uv pip install --python /tmp/sgl torch==2.14.1 transformers==5.19.0 torchaudio \
        fastapi uvicorn httpx pydantic numpy pyzmq msgpack msgspec pyyaml pybase64 xxhash \
        pillow av soundfile zstandard librosa qwen-vl-utils==0.0.11 starlette
    uv pip install --python /tmp/sgl --no-deps packages/omni-rollout-client
    /tmp/sgl/bin/python packages/omni-rollout-client/scripts/check_real_0_1_9.py [NAME-PART ...]

(``NAME-PART``: run only the cases whose name contains it.) Exit status 1 when a case fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import queue
import socket
import sys
import tempfile
import threading
import time
import warnings
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

warnings.filterwarnings("ignore")
logging.disable(logging.CRITICAL)  # the real layer logs every expected failure with a traceback

import numpy as np  # noqa: E402
import sglang.srt.runtime_context as runtime_context  # noqa: E402
import sglang_omni.model_runner.model_worker as model_worker_module  # noqa: E402
import torch  # noqa: E402
import uvicorn  # noqa: E402
from omni_rollout_client.testing import contract_cases as cases  # noqa: E402
from omni_rollout_client.testing.generator import (  # noqa: E402
    FakeGeneration,
    FakeRequest,
    make_hash_generator,
)
from sglang_omni.admission import AdminDroppedRequestError  # noqa: E402
from sglang_omni.client.client import Client  # noqa: E402
from sglang_omni.model_runner.model_worker import ModelWorker  # noqa: E402
from sglang_omni.models.qwen3_omni.components.preprocessor import (  # noqa: E402
    Qwen3OmniPreprocessor,
)
from sglang_omni.models.qwen3_omni.components.streaming_detokenizer import (  # noqa: E402
    build_decode_result,
)
from sglang_omni.models.qwen3_omni.payload_types import Qwen3OmniPipelineState  # noqa: E402
from sglang_omni.models.qwen3_omni.request_builders import (  # noqa: E402
    apply_thinker_result,
    build_sglang_thinker_request,
)
from sglang_omni.pipeline.coordinator import Coordinator  # noqa: E402
from sglang_omni.pipeline.stage.runtime import Stage, error_text  # noqa: E402
from sglang_omni.proto.messages import CompleteMessage  # noqa: E402
from sglang_omni.scheduling.omni_scheduler import OmniScheduler  # noqa: E402
from sglang_omni.serve.openai_api import ServerStatus, create_app  # noqa: E402

TEXT_ONLY = ["preprocessing", "image_encoder", "audio_encoder", "mm_aggregate", "thinker", "decode"]
SPEECH = [*TEXT_ONLY, "talker_ar", "code2wav"]
AR_STAGES = {"thinker", "talker_ar"}


# ------------------------------------------------------------------ the model, faked


class FakeModelRunner:
    """The GPU side of a weight update: loads "succeed" for an existing path / a joined group."""

    def __init__(self) -> None:
        self.groups: dict[str, dict[str, Any]] = {}
        self.delays: dict[str, float] = {}
        self.model_path = "/models/Qwen3-Omni"

    def _delay(self, action: str) -> None:
        time.sleep(self.delays.pop(action, 0.0))

    def update_weights_from_disk(self, model_path, load_format, recapture_cuda_graph=False):
        self._delay("update_weights_from_disk")
        if not Path(model_path).exists():
            return False, f"Failed to update weights: {model_path} does not exist."
        self.model_path = model_path
        return True, "Succeeded to update model weights."

    def init_weights_update_group(
        self, master_address, master_port, rank_offset, world_size, group_name, backend="nccl"
    ):
        self._delay("init_weights_update_group")
        self.groups[group_name] = {"world_size": world_size, "rank_offset": rank_offset}
        return True, "Succeeded to initialize custom process group."

    def destroy_weights_update_group(self, group_name):
        if self.groups.pop(group_name, None) is None:
            return False, f"The group {group_name} does not exist."
        return True, "Succeeded to destroy custom process group."

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name, load_format=None):
        self._delay("update_weights_from_distributed")
        if group_name not in self.groups:
            return (
                False,
                f"Failed to update parameter online: group {group_name} is not initialized.",
            )
        return True, "Succeeded to update parameter online."


class FakeWorker:
    """``ModelWorker``'s real wrappers (payload checks, weight_version bookkeeping) over the fake
    runner; only ``model_info`` and the weights checker are written here."""

    update_weights_from_disk = ModelWorker.update_weights_from_disk
    init_weights_update_group = ModelWorker.init_weights_update_group
    destroy_weights_update_group = ModelWorker.destroy_weights_update_group
    update_weights_from_distributed = ModelWorker.update_weights_from_distributed

    def __init__(self) -> None:
        self.model_runner = FakeModelRunner()
        self.server_args = SimpleNamespace(weight_version="default")

    def weights_checker(self, action: str) -> dict[str, Any]:
        digest = hashlib.sha256(self.server_args.weight_version.encode()).hexdigest()
        return {"action": action, "checksum": digest}


CURRENT_WORKER: threading.local = threading.local()


def _override_server_args(server_args: Any, source: str, **fields: Any) -> None:
    for key, value in fields.items():
        setattr(server_args, key, value)


# ModelWorker reads the loaded model's bag and writes weight_version through sglang's runtime
# context; the harness has no sglang runtime, so both point at the worker's own fields.
model_worker_module.override_server_args = _override_server_args
runtime_context.get_model = lambda: SimpleNamespace(
    load_format=None, model_path=CURRENT_WORKER.worker.model_runner.model_path
)


class FakeScheduler:
    """An AR stage's scheduler thread. The admin machinery is ``OmniScheduler``'s own code; the
    request bookkeeping it calls (abort all, retract, active ids) and the decode loop are fake."""

    admin = OmniScheduler.admin
    should_enqueue_admin = OmniScheduler.should_enqueue_admin
    enqueue_admin = OmniScheduler.enqueue_admin
    process_admin_requests = OmniScheduler.process_admin_requests
    run_admin_action_safely = OmniScheduler.run_admin_action_safely
    run_admin_action = OmniScheduler.run_admin_action
    answer_tp_admin_waiters = OmniScheduler.answer_tp_admin_waiters
    admin_pause_generation = OmniScheduler.admin_pause_generation
    admin_continue_generation = OmniScheduler.admin_continue_generation
    admin_update_weights_from_disk = OmniScheduler.admin_update_weights_from_disk
    run_weight_update_with_lifecycle = OmniScheduler.run_weight_update_with_lifecycle
    admin_update_weights_from_distributed = OmniScheduler.admin_update_weights_from_distributed
    admin_init_weights_update_group = OmniScheduler.admin_init_weights_update_group
    admin_destroy_weights_update_group = OmniScheduler.admin_destroy_weights_update_group
    admin_weights_checker = OmniScheduler.admin_weights_checker
    can_update_active_requests = OmniScheduler.can_update_active_requests

    def __init__(self, stage: str, token_delay_s: float) -> None:
        self.stage = stage
        self.model_worker = FakeWorker()
        self.admin_lock = threading.Lock()
        self.admin_queue: queue.Queue = queue.Queue()
        self.tp_size, self.tp_rank, self.is_entry_rank = 1, 0, True
        self.tp_admin_waiters: deque = deque()
        self.tp_admin_results: deque = deque()
        self._engine_paused = False
        self.last_pause_mode: str | None = None
        self.session_bridge = None
        self.token_delay_s = token_delay_s
        self.requests: dict[str, dict[str, Any]] = {}  # rid -> plan and progress
        self.req_lock = threading.Lock()
        self.emit: Any = None  # set by the pipeline: (rid, CompleteMessage) -> None, thread-safe
        self.running = True
        self.scheduler_thread_id: int | None = None
        self.thread = threading.Thread(target=self.loop, daemon=True, name=f"sched-{stage}")
        self.thread.start()

    # -- admin hooks OmniScheduler's code calls
    def admin_model_info(self) -> dict[str, Any]:
        with self.req_lock:
            active = len(self.requests)
        return {
            "success": True,
            "message": "ok",
            "data": {
                "stage_tp_rank": 0,
                "stage_tp_size": 1,
                "engine_paused": self._engine_paused,
                "waiting_queue_size": active if self._engine_paused else 0,
                "running_batch_size": 0 if self._engine_paused else active,
                "model_path": self.model_worker.model_runner.model_path,
                "load_format": None,
                "weight_version": self.model_worker.server_args.weight_version,
            },
        }

    def resolve_pending_async(self) -> None:
        pass

    def advance_prompt_cache_epoch(self) -> None:
        pass

    def flush_cache_after_update(self) -> bool:
        return True

    @staticmethod
    def empty_torch_cache() -> None:
        pass

    def active_request_ids(self) -> list[str]:
        with self.req_lock:
            return sorted(self.requests)

    def abort_all_requests(self) -> list[str]:
        with self.req_lock:
            rids = sorted(self.requests)
            dropped = [self.requests.pop(rid) for rid in rids]
        for req in dropped:
            req["record"].outcome = "aborted"
            self.emit(req["rid"], False, AdminDroppedRequestError.MESSAGE)
        return rids

    def retract_running_requests(self) -> int:
        with self.req_lock:
            return len(self.requests)  # kept, resumed on continue

    def abort(self, rid: str) -> None:
        with self.req_lock:
            req = self.requests.pop(rid, None)
        if req is not None:
            req["record"].outcome = "aborted"

    # -- requests
    def add(self, rid: str, req: dict[str, Any]) -> None:
        with self.req_lock:
            self.requests[rid] = req

    def loop(self) -> None:
        self.scheduler_thread_id = threading.get_ident()
        CURRENT_WORKER.worker = self.model_worker
        while self.running:
            self.process_admin_requests()
            if not self._engine_paused:
                finished = []
                with self.req_lock:
                    for rid, req in list(self.requests.items()):
                        req["done"] += 1
                        if req["done"] >= len(req["tokens"]):
                            finished.append(self.requests.pop(rid))
                for req in finished:
                    req["finish"](self.model_worker.server_args.weight_version)
            time.sleep(self.token_delay_s or 0.002)

    def stop(self) -> None:
        self.running = False


class FakeTokenizer:
    """What the thinker request builder and the decode stage ask of a tokenizer."""

    def __init__(self, eos: int) -> None:
        self.eos_token_id = eos

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        return " ".join(
            f"<{int(t)}>" for t in ids if not (skip_special_tokens and int(t) == self.eos_token_id)
        )

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(ch) % 4000 for ch in text]


def _digest(tensor: torch.Tensor) -> tuple[str, list[int], str]:
    t = tensor.contiguous()
    raw = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()
    return str(t.dtype).removeprefix("torch."), list(t.shape), hashlib.sha256(raw).hexdigest()


class Pipeline:
    """The stages and the coordinator's control plane, in-process."""

    def __init__(self, options: cases.ServerOptions, stages: list[str]) -> None:
        self.options = options
        self.eos = options.vocab_size - 1
        self.tokenizer = FakeTokenizer(self.eos)
        self.generator = make_hash_generator(options.vocab_size, self.eos)
        self.scheds = {s: FakeScheduler(s, options.token_delay_s) for s in stages if s in AR_STAGES}
        for sched in self.scheds.values():
            sched.emit = self._emit_from_thread
        self.stage_shells = {s: self._shell(s) for s in stages}
        self.preprocessor = object.__new__(Qwen3OmniPreprocessor)  # no HF processor: ids paths only
        self.preprocessor.max_seq_len = options.max_seq_len
        self.records: list[cases.Record] = []
        self.fail_next: dict[str, int] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.coord: Coordinator | None = None
        self.tasks: set[asyncio.Task[Any]] = set()
        self.counter = 0

    def _shell(self, stage: str) -> Any:
        shell = SimpleNamespace(name=stage, role="single", scheduler=self.scheds.get(stage))
        for name in ("run_admin_operation", "admin_result_from_outcome", "admin_result"):
            setattr(shell, name, getattr(Stage, name).__get__(shell))
        return shell

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _emit_from_thread(self, rid: str, success: bool, payload: Any) -> None:
        assert self.loop is not None and self.coord is not None
        msg = (
            CompleteMessage(rid, "decode", True, result=payload)
            if success
            else CompleteMessage(rid, "thinker", False, error=payload)
        )
        self.loop.call_soon_threadsafe(lambda: self._spawn(self.coord.handle_completion(msg)))

    # -- the coordinator's control plane
    async def submit_to_stage(self, stage: str, endpoint: str, msg: Any) -> None:
        self.loop = asyncio.get_running_loop()
        self._spawn(self._run_request(msg.request_id, msg.data))

    async def send_admin(self, stage: str, endpoint: str, msg: Any) -> None:
        action = msg.operation.action
        if self.fail_next.get(action):
            self.fail_next[action] -= 1
            raise RuntimeError(f"control plane send failed (injected) for {action}")
        shell = self.stage_shells[stage]

        async def run() -> None:
            result = await shell.run_admin_operation(msg.operation)
            self.coord.handle_admin_result(result)

        self._spawn(run())

    async def broadcast_abort(self, msg: Any) -> None:
        for sched in self.scheds.values():
            sched.abort(msg.request_id)

    def close(self) -> None:
        for sched in self.scheds.values():
            sched.stop()

    # -- one request through preprocessing -> thinker -> decode
    async def _run_request(self, rid: str, payload: Any) -> None:
        stage = "preprocessing"
        try:
            payload = await Qwen3OmniPreprocessor.call_impl(self.preprocessor, payload)
            stage = "thinker"
            state = Qwen3OmniPipelineState.from_dict(payload.data)
            params = dict(payload.request.params)
            data = build_sglang_thinker_request(
                state,
                params=params,
                tokenizer=self.tokenizer,
                vocab_size=self.options.vocab_size,
                request_id=rid,
            )
            flat: dict[str, torch.Tensor] = {}
            for inputs in (state.encoder_inputs or {}).values():
                flat.update({k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)})
            sp = data.req.sampling_params
            ids = [int(t) for t in state.prompt["input_ids"].tolist()]
            max_new = int(sp.max_new_tokens)
            temperature = float(params.get("temperature", 0.0))
            seed = params.get("seed")
            stop_ids = [int(t) for t in (params.get("stop_token_ids") or [])]
            self.counter += 1
            fake_req = FakeRequest(
                self.counter,
                ids,
                temperature,
                seed,
                max_new,
                stop_ids,
                {k: _np(v) for k, v in flat.items()},
                payload.request.metadata,
            )
            if self.options.long:
                gen = FakeGeneration([7] * max_new, [-0.5] * max_new)
            else:
                gen = self.generator(fake_req)
            tokens, logprobs = list(gen.token_ids)[:max_new], list(gen.logprobs)[:max_new]
            record = cases.Record(
                input_ids=ids,
                sampling={
                    "max_new_tokens": max_new,
                    "temperature": temperature,
                    "seed": seed,
                    "stop_token_ids": stop_ids,
                },
                tensors={k: _digest(v) for k, v in flat.items()},
                outcome="running",
            )
            self.records.append(record)
            eos = self.eos
            return_logprob = bool(params.get("return_logprob", True))

            def finish(version: str) -> None:
                finish_type = (
                    "length"
                    if len(tokens) >= max_new and tokens[-1] != eos and tokens[-1] not in stop_ids
                    else "stop"
                )
                data.output_ids = list(tokens)
                data.finish_reason = finish_type
                data.weight_version = version
                data.output_token_logprobs = (
                    [[float(lp), int(t)] for lp, t in zip(logprobs, tokens, strict=True)]
                    if return_logprob
                    else None
                )
                st = Qwen3OmniPipelineState.from_dict(payload.data)
                apply_thinker_result(st, stage_name="thinker", result=data)
                payload.data = st.to_dict()
                result = build_decode_result(
                    payload, tokenizer=self.tokenizer, eos_token_id=eos, is_streaming=False
                )
                record.outcome, record.token_ids, record.weight_version = (
                    "ok",
                    list(tokens),
                    version,
                )
                self._emit_from_thread(rid, True, result)

            self.scheds["thinker"].add(
                rid,
                {
                    "rid": rid,
                    "tokens": tokens or [eos],
                    "done": 0,
                    "finish": finish,
                    "record": record,
                },
            )
        except Exception as exc:  # a stage failure ends the request, as the stage shell does
            await self.coord.handle_completion(
                CompleteMessage(rid, stage, False, error=error_text(exc))
            )


def _np(tensor: torch.Tensor) -> np.ndarray:
    t = tensor.contiguous()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


class RealServerUnderTest(cases.ServerUnderTest):
    def __init__(self, options: cases.ServerOptions, weights: str) -> None:
        self.options = options
        self._weights = weights
        stages = SPEECH if options.speech else TEXT_ONLY
        self.pipeline = Pipeline(options, stages)
        self.eos_token_id = self.pipeline.eos
        coord = Coordinator(
            completion_endpoint="inproc://completion",
            abort_endpoint="inproc://abort",
            entry_stage="preprocessing",
            terminal_stages=["decode"],
            max_in_flight=options.max_in_flight,
        )
        for stage in stages:
            coord.register_stage(stage, f"inproc://{stage}")
        coord.control_plane = self.pipeline
        coord.running = True
        self.pipeline.coord = coord
        self.app = create_app(Client(coord), admin_api_key=options.admin_api_key)
        if options.starting:
            self.app.state.server_status = ServerStatus.STARTING
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="critical", lifespan="off"))
        self.thread = threading.Thread(
            target=lambda: asyncio.run(self.server.serve(sockets=[sock])), daemon=True
        )
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.pipeline.close()

    def slow_admin(self, route: str, seconds: float) -> None:
        self.pipeline.scheds["thinker"].model_worker.model_runner.delays[route.lstrip("/")] = (
            seconds
        )

    def fail_admin(self, route: str, count: int) -> None:
        self.pipeline.fail_next[route.lstrip("/")] = count

    def set_ready(self) -> None:
        self.app.state.server_status = ServerStatus.UP

    def active_count(self) -> int:
        return len(self.pipeline.scheds["thinker"].active_request_ids())

    def records(self) -> list[cases.Record]:
        return list(self.pipeline.records)

    def stage_version(self, stage: str) -> str | None:
        return self.pipeline.scheds[stage].model_worker.server_args.weight_version

    def engine_paused(self) -> bool:
        return bool(self.pipeline.scheds["thinker"]._engine_paused)

    def weights_dir(self) -> str:
        return self._weights


@contextlib.contextmanager
def real_server(options: cases.ServerOptions) -> Iterator[cases.ServerUnderTest]:
    with tempfile.TemporaryDirectory(prefix="omni-real-") as weights:
        server = RealServerUnderTest(options, weights)
        try:
            yield server
        finally:
            server.close()


if __name__ == "__main__":
    summary = cases.run_all(real_server, sys.argv[1:] or None)
    sys.exit(0 if summary["passed"] == summary["total"] else 1)
