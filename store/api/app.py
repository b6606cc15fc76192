"""The aiohttp application: its routes (one table, which ``openapi`` documents), and the
middleware that authenticates, answers every error as a JSON (or msgpack) body, and counts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from pydantic import BaseModel

from store.client import RolloutClient
from store.logs import log_event

from . import openapi, schemas, wire
from .auth import BearerAuth
from .cli import DEFAULT_MAX_BODY_BYTES
from .errors import ApiError, from_exception
from .handlers import Handlers
from .metrics import ApiMetrics

log = logging.getLogger("rollouts.api")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_HANDLERS: web.AppKey[Handlers] = web.AppKey("handlers", Handlers)


@dataclass(frozen=True, slots=True)
class Route:
    """One endpoint: what it does, and what ``/openapi.json`` says of it."""

    method: str
    path: str
    name: str  # the ``Handlers`` method, and the operationId
    summary: str
    body: type[BaseModel] | None = None
    response: type[BaseModel] | None = None
    errors: tuple[int, ...] = ()
    query: type[BaseModel] | None = None
    stream: bool = False  # NDJSON (or a msgpack sequence) of ``response`` | StreamError
    text: bool = False  # text/plain (Prometheus exposition)


_BODY_ERRORS = (400, 413, 422)
ROUTES: tuple[Route, ...] = (
    Route("POST", "/v1/batches", "submit",
          "Submit n samples of each prompt (RolloutClient.submit); idempotent per batch_id",
          schemas.SubmitRequest, schemas.SubmitResponse, (*_BODY_ERRORS, 409)),
    Route("GET", "/v1/batches", "batches",
          "Every batch still recorded, oldest first", response=schemas.BatchList),
    Route("GET", "/v1/batches/{batch_id}", "batch", "A batch as recorded at submit",
          response=schemas.BatchInfo, errors=(404, 422)),
    Route("GET", "/v1/batches/{batch_id}/results", "results",
          "The batch's results in completion order, one per line, as they end; resume with "
          "after=<position>; take=k: the first k groups, then the rest is cancelled",
          response=schemas.Result, errors=(404, 422), query=schemas.ResultsQuery, stream=True),
    Route("GET", "/v1/rollouts/{rollout_id}", "rollout",
          "A rollout now: state, tokens so far", response=schemas.Rollout, errors=(404, 422)),
    Route("GET", "/v1/rollouts/{rollout_id}/events", "events",
          "A rollout's recorded events, decoded", response=schemas.Events, errors=(404, 422)),
    Route("POST", "/v1/cancel", "cancel",
          "Cancel rollouts by id, a batch, or a group; 409 for an ended rollout named by id",
          schemas.CancelRequest, schemas.Cancelled, (*_BODY_ERRORS, 404, 409)),
    Route("POST", "/v1/ack", "ack", "Delete ended rollouts (live ones are kept and listed)",
          schemas.AckRequest, schemas.AckReport, (*_BODY_ERRORS, 404)),
    Route("POST", "/v1/weights", "publish",
          "Publish a weight version (above every published one); workers pick it up",
          schemas.PublishWeightsRequest, schemas.WeightVersion, (*_BODY_ERRORS, 409)),
    Route("GET", "/v1/stats", "stats", "Rollouts by state, tokens, queues, workers",
          response=schemas.Stats),
    Route("GET", "/healthz", "healthz", "Redis answers a PING within 2 s (no auth)",
          response=schemas.Health, errors=(503,)),
    Route("GET", "/metrics", "metrics_text", "Prometheus metrics", text=True),
)  # fmt: skip


def make_app(
    client: RolloutClient,
    *,
    token: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    close_client: bool = False,
) -> web.Application:
    """The API over ``client``; ``close_client``: close it with the app (the CLI's own)."""
    metrics = ApiMetrics()
    auth = BearerAuth(token)
    app = web.Application(client_max_size=max_body_bytes, middlewares=[_middleware(auth, metrics)])
    handlers = Handlers(client, metrics)
    app[_HANDLERS] = handlers
    document = openapi.build(ROUTES, secured=auth.enabled)
    for route in ROUTES:
        app.router.add_route(route.method, route.path, getattr(handlers, route.name),
                             name=route.name)  # fmt: skip

    async def serve_openapi(request: web.Request) -> web.Response:
        return web.json_response(document)

    app.router.add_get("/openapi.json", serve_openapi, name="openapi")
    if close_client:

        async def close(_: web.Application) -> None:
            await client.aclose()

        app.on_cleanup.append(close)
    return app


def _middleware(auth: BearerAuth, metrics: ApiMetrics) -> Any:
    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        t0 = time.perf_counter()
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "unmatched"
        try:
            auth.check(request.path, request.headers.get("Authorization"))
            response = await handler(request)
        except web.HTTPException as exc:
            # aiohttp's own refusals: no such route (404), method (405), a body over
            # client_max_size (413). Same error body as ours; Allow headers kept.
            error = ApiError(exc.status, _slug(exc.reason), exc.reason)
            response = _error_response(request, error)
            if "Allow" in exc.headers:
                response.headers["Allow"] = exc.headers["Allow"]
        except Exception as exc:
            error_or_none = from_exception(exc)
            if error_or_none is None:
                # A bug, not a refusal: logged in full, answered without internals.
                log_event(log, logging.ERROR, "error", "unexpected error", route=route,
                          method=request.method, error=type(exc).__name__)  # fmt: skip
                log.exception("unexpected error in %s %s", request.method, route)
                error_or_none = ApiError(500, "internal", "internal error")
            response = _error_response(request, error_or_none)
        metrics.observe(route, request.method, response.status, time.perf_counter() - t0)
        return response

    return middleware


def _error_response(request: web.Request, error: ApiError) -> web.Response:
    out = wire.wants_msgpack(request.headers.get("Accept", ""))
    response = web.Response(
        body=wire.encode(error.body(), out),
        status=error.status,
        content_type=wire.MSGPACK if out else wire.JSON,
    )
    if error.status == 401:
        response.headers["WWW-Authenticate"] = 'Bearer realm="rollouts"'
    return response


def _slug(reason: str) -> str:
    return reason.lower().replace(" ", "_")
