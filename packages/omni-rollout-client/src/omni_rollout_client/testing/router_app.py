"""A fake sglang-omni router: round-robin /generate proxy, /workers listing, admin broadcast.

Mirrors the router behaviour the client depends on: admin routes fan out to every live worker and
answer ``{success, message, path, worker_count, results: [{worker, success, status_code, body}]}``
(502 if any failed), mixed weight versions on /model_info are a 409, and group init with more than
one live worker is refused with 422 (each worker needs its own rank offset).
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .admin_key import admin_key_refusal
from .serving import BackgroundServer

ADMIN_ROUTES = (
    "/pause_generation",
    "/continue_generation",
    "/update_weights_from_disk",
    "/update_weights_from_distributed",
    "/init_weights_update_group",
    "/destroy_weights_update_group",
)


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


class FakeRouterApp:
    def __init__(self, worker_urls: list[str], *, admin_api_key: str | None = None):
        self.workers = [
            {
                "worker_id": f"w{i}",
                "display_id": f"worker-{i}",
                "url": url.rstrip("/"),
                "model": None,
                "capabilities": ["chat"],
                "active_requests": 0,
                "health_state": "healthy",
                "disabled": False,
                "routable": True,
            }
            for i, url in enumerate(worker_urls)
        ]
        self._rr = itertools.count()
        self._key = admin_api_key
        self.http: httpx.AsyncClient | None = None
        routes = [
            Route("/live", self.live, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/ready", self.health, methods=["GET"]),
            Route("/workers", self.list_workers, methods=["GET"]),
            Route("/generate", self.generate, methods=["POST"]),
            Route("/model_info", self.model_info, methods=["GET", "POST"]),
            Route(
                "/weights_checker",
                self.broadcast_route("/weights_checker"),
                methods=["GET", "POST"],
            ),
            Route("/update_weights_from_tensor", self.tensor_stub, methods=["POST"]),
            *[Route(path, self.broadcast_route(path), methods=["POST"]) for path in ADMIN_ROUTES],
        ]
        self.app = Starlette(routes=routes, exception_handlers={404: self._not_found})

    async def _not_found(self, request: Request, exc: Exception) -> Response:
        return JSONResponse({"detail": "Not Found"}, status_code=404)

    def _client(self) -> httpx.AsyncClient:
        if self.http is None:
            self.http = httpx.AsyncClient(timeout=httpx.Timeout(1800.0, connect=5.0))
        return self.http

    def _auth_error(self, request: Request) -> Response | None:
        refusal = admin_key_refusal(request.headers.get("authorization"), self._key)
        if refusal is None:
            return None
        status, detail, headers = refusal
        return JSONResponse({"detail": detail}, status_code=status, headers=headers)

    def _summary(self, status: str) -> dict[str, Any]:
        routable = sum(w["routable"] for w in self.workers)
        return {
            "status": status,
            "healthy_workers": routable,
            "dead_workers": 0,
            "disabled_workers": sum(w["disabled"] for w in self.workers),
            "routable_workers": routable,
            "unhealthy_workers": 0,
            "unknown_workers": 0,
            "total_workers": len(self.workers),
            "workers": [dict(w) for w in self.workers],
        }

    async def live(self, request: Request) -> Response:
        return JSONResponse({"status": "alive"})

    async def health(self, request: Request) -> Response:
        ok = any(w["routable"] for w in self.workers)
        return JSONResponse(
            self._summary("healthy" if ok else "unhealthy"), status_code=200 if ok else 503
        )

    async def list_workers(self, request: Request) -> Response:
        return JSONResponse(self._summary("ok"))

    async def generate(self, request: Request) -> Response:
        routable = [w for w in self.workers if w["routable"]]
        if not routable:
            return _error(503, "no eligible upstream")
        worker = routable[next(self._rr) % len(routable)]
        body = await request.body()
        worker["active_requests"] += 1
        try:
            upstream = await self._client().post(
                worker["url"] + "/generate",
                content=body,
                headers={"content-type": "application/json"},
            )
        except httpx.HTTPError as exc:
            return _error(502, f"upstream {worker['url']} failed: {type(exc).__name__}")
        finally:
            worker["active_requests"] -= 1
        return Response(
            upstream.content,
            status_code=upstream.status_code,
            media_type=upstream.headers.get("content-type"),
        )

    async def _fan_out(self, request: Request, path: str) -> list[dict[str, Any]]:
        body = await request.body()
        headers = {
            k: v
            for k, v in request.headers.items()
            if k.lower() in ("authorization", "content-type")
        }
        results = []
        for worker in self.workers:
            try:
                upstream = await self._client().request(
                    request.method,
                    worker["url"] + path,
                    content=body,
                    headers=headers,
                    params=dict(request.query_params),
                )
            except httpx.HTTPError as exc:
                results.append(
                    {"worker": worker["url"], "success": False, "error": type(exc).__name__}
                )
                continue
            try:
                payload = upstream.json()
            except json.JSONDecodeError:
                payload = upstream.text
            body_ok = payload.get("success", True) if isinstance(payload, dict) else True
            results.append(
                {
                    "worker": worker["url"],
                    "success": upstream.status_code < 300 and body_ok is not False,
                    "status_code": upstream.status_code,
                    "body": payload,
                }
            )
        return results

    def broadcast_route(self, path: str):
        async def handler(request: Request) -> Response:
            if (denied := self._auth_error(request)) is not None:
                return denied
            if path == "/init_weights_update_group" and len(self.workers) > 1:
                return _error(
                    422,
                    f"distributed weight-update init currently supports a single-replica target stage, but {len(self.workers)} live workers were targeted; multi-replica refit needs a distinct rank_offset per replica.",
                )
            results = await self._fan_out(request, path)
            success = all(r["success"] for r in results)
            payload = {
                "success": success,
                "message": "ok" if success else "one or more workers failed admin request",
                "path": path,
                "worker_count": len(results),
                "results": results,
            }
            return JSONResponse(payload, status_code=200 if success else 502)

        return handler

    async def model_info(self, request: Request) -> Response:
        if (denied := self._auth_error(request)) is not None:
            return denied
        results = await self._fan_out(request, "/model_info")
        if not all(r["success"] for r in results):
            return JSONResponse(
                {
                    "success": False,
                    "message": "one or more workers failed model_info request",
                    "path": "/model_info",
                    "worker_count": len(results),
                    "workers": results,
                    "results": results,
                },
                status_code=502,
            )
        versions = {r["body"].get("weight_version") for r in results}
        if len(versions) > 1:
            return JSONResponse(
                {
                    "detail": {
                        "success": False,
                        "message": "mixed worker weight_version",
                        "mixed_state": {"weight_version": sorted(map(str, versions))},
                    }
                },
                status_code=409,
            )

        def common(key: str) -> Any:
            values = {json.dumps(r["body"].get(key)) for r in results}
            return json.loads(values.pop()) if len(values) == 1 else None

        return JSONResponse(
            {
                "success": True,
                "message": "ok",
                "path": "/model_info",
                "worker_count": len(results),
                "weight_version": common("weight_version"),
                "model_path": common("model_path"),
                "load_format": common("load_format"),
                "workers": results,
                "results": results,
            }
        )

    async def tensor_stub(self, request: Request) -> Response:
        if (denied := self._auth_error(request)) is not None:
            return denied
        return JSONResponse(
            {
                "error": {
                    "message": "This weight update path is not yet implemented. Use /update_weights_from_disk for the disk-based update path.",
                    "code": "not_implemented",
                }
            },
            status_code=501,
        )


class FakeOmniRouter(BackgroundServer):
    """``with FakeOmniRouter([w1.url, w2.url]) as router: router.url``."""

    def __init__(
        self,
        worker_urls: list[str],
        *,
        admin_api_key: str | None = None,
        log_level: str = "warning",
    ):
        self.router = FakeRouterApp(worker_urls, admin_api_key=admin_api_key)
        super().__init__(self.router.app, log_level=log_level)
