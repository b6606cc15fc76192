"""The aiohttp application: its routes (one table, which ``openapi`` documents), and the
middleware that authenticates, answers every error as a JSON (or msgpack) body, and counts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from aiohttp import web

from store import defaults
from store.client import RolloutClient
from store.environment import EnvironmentClient
from store.logs import log_event

from . import env_routes, openapi, schemas, trajectory_schemas, wire
from .auth import BearerAuth
from .errors import ApiError, from_exception
from .handlers import Handlers
from .harness import chat_tools, control
from .harness import routes as harness
from .harness.call import Calls
from .metrics import ApiMetrics
from .route import Route

log = logging.getLogger("rollouts.api")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_HANDLERS: web.AppKey[Handlers] = web.AppKey("handlers", Handlers)


_BODY_ERRORS = (400, 413, 422)
ROUTES: tuple[Route, ...] = (
    Route("POST", "/v1/batches", "submit",
          "Submit n samples of each prompt (RolloutClient.submit); idempotent per batch_id",
          schemas.SubmitRequest, schemas.SubmitResponse, (*_BODY_ERRORS, 409, 503),
          tokens_body=schemas.SubmitTokensRequest),
    Route("GET", "/v1/batches", "batches",
          "Every batch still recorded, oldest first", response=schemas.BatchList),
    Route("GET", "/v1/batches/{batch_id}", "batch", "A batch as recorded at submit",
          response=schemas.BatchInfo, errors=(404, 422)),
    Route("GET", "/v1/batches/{batch_id}/results", "results",
          "The batch's results in completion order, one per line, as they end; resume with "
          "after=<position>. No side effect (take=k, which cancels, is POST .../take)",
          response=schemas.Result, errors=(404, 422, 503), query=schemas.ResultsQuery, stream=True),
    Route("POST", "/v1/batches/{batch_id}/take", "take",
          "The first `groups` groups to finish, whole, one result per line; then the rest of "
          "the batch is cancelled (RolloutClient.results(take=k))",
          schemas.TakeRequest, schemas.Result, (*_BODY_ERRORS, 404, 503), stream=True),
    # Before the session's own route, whose id runs to the end of the path (see make_app).
    Route("GET", "/v1/sessions/{session_id}/trajectory", "trajectory",
          "A session's calls as one trajectory: the first call's prompt, then per call the "
          "tokens its prompt added (loss 0) and its response (loss 1); a call whose prompt "
          "does not extend the one before starts a new segment",
          response=trajectory_schemas.Trajectory, errors=(422,)),
    Route("GET", "/v1/sessions/{session_id}", "session",
          "A session's calls (X-Session-ID) in the order they were made, with their rollouts' "
          "states; none for an unknown session", response=schemas.Session, errors=(422,)),
    Route("GET", "/v1/rollouts/{rollout_id}", "rollout",
          "A rollout now: state, tokens so far", response=schemas.Rollout, errors=(404, 422)),
    Route("GET", "/v1/rollouts/{rollout_id}/events", "events",
          "A rollout's recorded events, decoded", response=schemas.Events, errors=(404, 422)),
    Route("POST", "/v1/cancel", "cancel",
          "Cancel rollouts by id, a batch, or a group; 409 for an ended rollout named by id",
          schemas.CancelRequest, schemas.Cancelled, (*_BODY_ERRORS, 404, 409, 503)),
    Route("POST", "/v1/ack", "ack", "Delete ended rollouts (live ones are kept and listed)",
          schemas.AckRequest, schemas.AckReport, (*_BODY_ERRORS, 404, 503)),
    Route("POST", "/v1/weights", "publish",
          "Publish a weight version (above every published one); workers pick it up",
          schemas.PublishWeightsRequest, schemas.WeightVersion, (*_BODY_ERRORS, 409, 503)),
    Route("GET", "/v1/stats", "stats", "Rollouts by state, tokens, queues, workers",
          response=schemas.Stats),
    Route("GET", "/healthz", "healthz",
          "Redis answers within 2 s and accepts writes (no auth); if not, why not",
          response=schemas.Health, errors=(503,)),
    Route("GET", "/metrics", "metrics_text", "Prometheus metrics", text=True),
)  # fmt: skip


def make_app(
    client: RolloutClient,
    *,
    token: str | None = None,
    max_body_bytes: int = defaults.API_MAX_BODY_BYTES,
    close_client: bool = False,
    calls: Calls | None = None,
    environment: EnvironmentClient | None = None,
) -> web.Application:
    """The API over ``client``; ``close_client``: close it with the app (the CLI's own);
    ``calls``: how harness calls are run (``store.api.harness.call``; default bounds);
    ``environment``: what serves the environment routes (default: one over ``client``'s
    store, with the default lease and retries)."""
    metrics = ApiMetrics()
    auth = BearerAuth(token)
    every = (*ROUTES, *harness.routes(), *env_routes.ROUTES)
    routes, refused = (every, {}) if client.tokenizer is not None else tokens_only(every)
    if client.tokenizer is not None and not chat_tools.renders_tools(client.tokenizer):
        routes = tuple(replace(r, body=r.no_tools_body) if r.no_tools_body else r
                       for r in routes)  # fmt: skip
    openai_style = {r.path for r in every if r.harness}
    middleware = _middleware(auth, metrics, openai_style, refused)
    app = web.Application(client_max_size=max_body_bytes, middlewares=[middleware])
    handlers = Handlers(client, metrics, submit=_route(routes, "submit").body)  # type: ignore[arg-type]
    app[_HANDLERS] = handlers
    served = harness.handlers(calls or Calls(client))
    served |= env_routes.handlers(environment or EnvironmentClient(
        client.store, client.sync_redis, queue_apart=client.queue_apart))  # fmt: skip
    document = openapi.build(routes, secured=auth.enabled)
    for route in routes:
        handler = served[route.name] if route.name in served else getattr(handlers, route.name)
        # A session id is the harness's and may hold a slash (%2F, decoded before routing):
        # its segment matches to the end. The canonical path, documented, stays the same.
        path = route.path.replace("{session_id}", r"{session_id:[\s\S]+}")
        app.router.add_route(route.method, path, handler, name=route.name)

    async def serve_openapi(request: web.Request) -> web.Response:
        return web.json_response(document)

    app.router.add_get("/openapi.json", serve_openapi, name="openapi")
    if close_client:

        async def close(_: web.Application) -> None:
            await client.aclose()

        app.on_cleanup.append(close)
    return app


def tokens_only(routes: tuple[Route, ...]) -> tuple[tuple[Route, ...], dict[str, tuple[str, str]]]:
    """What an API without a tokenizer serves: it can neither tokenize text nor apply a chat
    template. A route with a ``tokens_body`` takes it (prompts as token ids only) and its
    document says so; a route that ``needs_tokenizer`` is left out (router and document
    alike, so that the document promises nothing it refuses): its path -> the refusal a call
    to it gets instead of a bare 404 (``no_tokenizer``)."""
    served = tuple(
        replace(r, body=r.tokens_body) if r.tokens_body is not None else r
        for r in routes
        if r.needs_tokenizer is None
    )
    refused = {r.path: r.needs_tokenizer for r in routes if r.needs_tokenizer is not None}
    return served, refused


def no_tokenizer(needs: tuple[str, str]) -> ApiError:
    """The refusal of a call to a route that ``needs_tokenizer`` (field, why)."""
    field, why = needs
    return ApiError(422, "no_tokenizer", f"{field}: {why}", field)


def _route(routes: tuple[Route, ...], name: str) -> Route:
    return next(r for r in routes if r.name == name)


def _middleware(
    auth: BearerAuth,
    metrics: ApiMetrics,
    openai_style: set[str],
    refused: dict[str, tuple[str, str]],
) -> Any:
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
            # A control path of vLLM/SkyRL that we do not serve: said so, in their body.
            not_served = control.unserved(request.path) if exc.status == 404 else None
            error = not_served or error
            if exc.status == 404 and request.path in refused:  # not served without a tokenizer
                error = no_tokenizer(refused[request.path])
            openai = route in openai_style or request.path in openai_style or bool(not_served)
            response = _error_response(request, error, openai)
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
            response = _error_response(request, error_or_none, route in openai_style)
        metrics.observe(route, request.method, response.status, time.perf_counter() - t0)
        return response

    return middleware


def _error_response(request: web.Request, error: ApiError, openai: bool = False) -> web.Response:
    out = wire.wants_msgpack(request.headers.get("Accept", ""))
    response = web.Response(
        body=wire.encode(error.openai_body() if openai else error.body(), out),
        status=error.status,
        content_type=wire.MSGPACK if out else wire.JSON,
    )
    if error.status == 401:
        response.headers["WWW-Authenticate"] = 'Bearer realm="rollouts"'
    if error.retry_after_s is not None:
        response.headers["Retry-After"] = str(error.retry_after_s)
    if openai and error.status == 409:
        # The openai client retries a 409 (a lock timeout, to OpenAI): here it is a key reused
        # with another body, which no retry mends.
        response.headers["x-should-retry"] = "false"
    return response


def _slug(reason: str) -> str:
    return reason.lower().replace(" ", "_")
