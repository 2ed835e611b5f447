"""omni-rollout-client against the REAL sglang-omni 0.1.9 HTTP layer, admin contract.

The unmodified ``create_app``, ``Client`` and ``Coordinator`` of the 0.1.9 wheel (routes, pydantic
validation, ``timeout_s`` -> ``wait_for``, admin aggregation, ``model_info_response``'s 409) run
on loopback; only the stages are fake: a control plane that hands each admin operation to a
serial scheduler per AR stage (``thinker``, ``talker_ar``), as sglang's scheduler thread does.
Prints one line per case and a JSON summary. Needs a throwaway venv (not the workspace's):

    uv venv /tmp/sgl --python 3.11
    uv pip install --python /tmp/sgl sglang-omni==0.1.9 uvicorn   # pins its own torch
    uv pip install --python /tmp/sgl --no-deps packages/omni-rollout-client
    /tmp/sgl/bin/python packages/omni-rollout-client/scripts/check_real_0_1_9.py
"""

import asyncio
import json
import socket
import threading
import time

import httpx
import uvicorn
from sglang_omni.client.client import Client
from sglang_omni.pipeline.coordinator import Coordinator
from sglang_omni.proto.admin import AdminResult
from sglang_omni.serve.openai_api import create_app

SPEECH = [
    "preprocessing",
    "image_encoder",
    "audio_encoder",
    "mm_aggregate",
    "thinker",
    "decode",
    "talker_ar",
    "code2wav",
]
AR = {"thinker", "talker_ar"}


class FakeScheduler:
    def __init__(self, stage):
        self.stage = stage
        self.lock = threading.Lock()
        self.version = "default"
        self.paused = False
        self.delays = {}
        self.model_path = "/m"

    def admin(self, action, payload):
        with self.lock:  # one admin op at a time on the scheduler thread
            time.sleep(self.delays.pop(action, 0.0))
            if action == "model_info":
                return {
                    "success": True,
                    "data": {
                        "stage_tp_rank": 0,
                        "stage_tp_size": 1,
                        "engine_paused": self.paused,
                        "waiting_queue_size": 0,
                        "running_batch_size": 0,
                        "model_path": self.model_path,
                        "load_format": None,
                        "weight_version": self.version,
                    },
                }
            if action == "pause_generation":
                self.paused = True
                return {
                    "success": True,
                    "data": {
                        "mode": payload.get("mode"),
                        "num_paused_requests": 0,
                        "engine_paused": True,
                    },
                }
            if action == "continue_generation":
                self.paused = False
                return {"success": True, "data": {"engine_paused": False}}
            if action == "update_weights_from_disk":
                self.model_path = payload["model_path"]
                if payload.get("weight_version") is not None:
                    self.version = payload["weight_version"]
                return {
                    "success": True,
                    "message": "Succeeded to update model weights.",
                    "data": {
                        "engine_paused": self.paused,
                        "weight_version": payload.get("weight_version"),
                    },
                }
            return {"success": True, "data": {}}


class FakeControlPlane:
    def __init__(self, coord, scheds):
        self.coord, self.scheds, self.fail_next = coord, scheds, 0

    async def send_admin(self, stage, endpoint, msg):
        if self.fail_next:
            self.fail_next -= 1
            raise RuntimeError("control plane send failed (injected)")
        op = msg.operation

        async def run():
            sched = self.scheds.get(stage)
            if sched is None:
                res = AdminResult(
                    op.op_id,
                    stage,
                    op.action,
                    True,
                    "stage does not support admin operations",
                    {"skipped": True, "unsupported": True},
                )
            else:
                out = await asyncio.get_running_loop().run_in_executor(
                    None, lambda: sched.admin(op.action, dict(op.payload))
                )
                data = dict(out.get("data") or {})
                res = AdminResult(
                    op.op_id,
                    stage,
                    op.action,
                    bool(out.get("success", True)),
                    str(out.get("message") or "ok"),
                    data,
                    out.get("error"),
                )
            self.coord.handle_admin_result(res)

        asyncio.get_running_loop().create_task(run())

    def close(self):
        pass


def serve(stages):
    coord = Coordinator(
        completion_endpoint="inproc://c",
        abort_endpoint="inproc://a",
        entry_stage="preprocessing",
        terminal_stages=["decode"],
    )
    scheds = {s: FakeScheduler(s) for s in stages if s in AR}
    for s in stages:
        coord.register_stage(s, f"inproc://{s}")
    coord.control_plane = FakeControlPlane(coord, scheds)
    coord.running = True
    app = create_app(Client(coord))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="error", lifespan="off"))
    t = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    t.start()
    while not server.started:
        time.sleep(0.01)
    return f"http://127.0.0.1:{port}", coord, scheds, server


results = []


def case(name, ok, detail=""):
    results.append((name, ok))
    print(("PASS" if ok else "FAIL"), name, detail)


async def main():
    from omni_rollout_client import (
        ConflictError,
        OmniRolloutClient,
        RetryPolicy,
        Timeouts,
        TransientServerError,
    )

    url, coord, scheds, server = serve(SPEECH)
    fast = RetryPolicy(max_attempts=4, base_delay_s=0.01, max_delay_s=0.05)
    async with OmniRolloutClient(url, retry=fast) as c:
        info = await c.model_info()
        case(
            "model_info scoped (POST stages+timeout_s accepted)",
            info.weight_version == "default" and info.thinker_tp_sizes == (1,),
        )
        await c.pause_generation("retract")
        await c.update_weights_from_disk("/w1", weight_version="v1")
        await c.continue_generation()
        case(
            "thinker-only update leaves talker on 'default'",
            scheds["talker_ar"].version == "default" and scheds["thinker"].version == "v1",
        )
        r = httpx.get(url + "/model_info")
        case(
            "real unscoped GET /model_info answers 409 (mixed)",
            r.status_code == 409,
            str(r.status_code),
        )
        try:
            await c.model_info(stages=None)
            case("client stages=None raises ConflictError", False)
        except ConflictError:
            case("client stages=None raises ConflictError", True)
        info = await c.model_info()
        case("client model_info() (scoped) after the update", info.weight_version == "v1")
        await c.wait_until_ready(timeout_s=5, poll_s=0.05)
        case("wait_until_ready on the speech pipeline", True)
    # timeout_s: server-side wait_for times out -> 500, update still applied
    async with OmniRolloutClient(url, retry=fast, timeouts=Timeouts(admin=1.0)) as c:
        scheds["thinker"].delays["update_weights_from_disk"] = 1.3
        reply = await c.update_weights_from_disk("/w2", weight_version="v2")
        case(
            "timed-out disk update (server 500) recognised as applied by re-reading the version",
            reply.success and "recovered_from" in reply.body,
            str(reply.body)[:160],
        )
        case("  ... and /model_info shows v2", (await c.model_info()).weight_version == "v2")
    raw = httpx.Client(base_url=url, timeout=10)
    scheds["thinker"].delays["update_weights_from_disk"] = 0.5
    r = raw.post(
        "/update_weights_from_disk",
        json={
            "model_path": "/w3",
            "weight_version": "raw3",
            "timeout_s": 0.1,
            "stages": ["thinker"],
        },
    )
    time.sleep(0.7)
    v = raw.post("/model_info", json={"stages": ["thinker"]}).json()["weight_version"]
    case(
        "real layer: tiny timeout_s -> 500 while the scheduler applies it",
        r.status_code == 500 and v == "raw3",
        f"{r.status_code} {r.text[:40]!r} then {v}",
    )
    # transient 500 on the disk update (uncaught error in the coordinator) is retried
    async with OmniRolloutClient(url, retry=fast) as c:
        coord.control_plane.fail_next = 1
        reply = await c.update_weights_from_disk("/w4", weight_version="v4")
        case(
            "transient 500 on /update_weights_from_disk retried",
            reply.success and scheds["thinker"].version == "v4",
        )
        coord.control_plane.fail_next = 99
        try:
            await c.update_weights_from_disk("/w5", weight_version="v5")
            case("bounded retries", False)
        except TransientServerError as exc:
            case(
                "bounded retries, version checked",
                exc.attempts == 4 and "does not report weight_version 'v5'" in str(exc),
                str(exc)[:120],
            )
        coord.control_plane.fail_next = 0
        # unknown stage -> 500; the next pooled request still works
        try:
            await c.pause_generation("retract", stages=["nope"])
            case("unknown stage 500", False)
        except TransientServerError as exc:
            case("unknown stage -> 500 (client gives up, typed)", exc.status_code == 500)
        case(
            "next request after the unknown-stage 500",
            (await c.model_info()).weight_version == "v4",
        )
        # pause payload validation: mode garbage is a stage error -> 400
        sent = raw.post(
            "/pause_generation", json={"mode": "retract", "stages": ["thinker"], "timeout_s": 5.0}
        )
        case("pause with timeout_s accepted", sent.status_code == 200, str(sent.status_code))
    server.should_exit = True
    print(json.dumps({"passed": sum(ok for _, ok in results), "total": len(results)}))


asyncio.run(main())
