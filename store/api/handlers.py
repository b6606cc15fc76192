"""The request handlers: validate with ``schemas``, call ``RolloutClient``, reply with ``views``.

Nothing about rollouts is done here: each handler is one call of the trainer API. A refusal
raises (``ApiError`` or the trainer API's named error) and the error middleware answers it;
every check runs before the call, and the trainer API itself writes nothing when it refuses.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from statemachine import EpisodeSpec, InvalidRequest, RolloutRequest, SamplingParams
from store import completions, defaults, writable
from store.client import RolloutClient
from store.completions import WaitTimeout
from store.errors import RolloutNotFound
from store.keys import check_batch_id, check_rollout_id, check_session_id
from store.logs import log_event
from store.results import RolloutResult
from store.submission import ChatRequest, Prompt

from . import schemas, views, wire
from .env_schemas import Episode
from .errors import ApiError, _field_of, from_exception, from_validation, refused
from .metrics import ApiMetrics

log = logging.getLogger("rollouts.api")
M = TypeVar("M", bound=BaseModel)
# /healthz answers within this even when Redis is down (the client would retry for ~15 s).
HEALTH_TIMEOUT_S = 2.0


def reply(request: web.Request, body: Any, status: int = 200) -> web.Response:
    out = wire.wants_msgpack(request.headers.get("Accept", ""))
    return web.Response(
        body=wire.encode(body, out),
        status=status,
        content_type=wire.MSGPACK if out else wire.JSON,
    )


async def parse(request: web.Request, model: type[M]) -> M:
    raw = await request.read()  # aiohttp refuses a body over client_max_size here (413)
    data = wire.decode_body(raw, request.headers.get("Content-Type", ""))
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation(exc) from None


def _path_id(request: web.Request, name: str) -> str:
    value = request.match_info[name]
    try:
        check = {"batch_id": check_batch_id, "session_id": check_session_id}
        return check.get(name, check_rollout_id)(value)
    except ValueError as exc:
        raise ApiError(422, "invalid_id", str(exc), name) from None


class Handlers:
    def __init__(
        self,
        client: RolloutClient,
        metrics: ApiMetrics,
        *,
        submit: type[schemas.SubmitRequest] = schemas.SubmitRequest,
    ) -> None:
        self.client = client
        self.metrics = metrics
        self.submit_body = submit  # SubmitTokensRequest without a tokenizer (``app``)

    # -- submit -------------------------------------------------------------------------------
    async def submit(self, request: web.Request) -> web.Response:
        body = await parse(request, self.submit_body)
        shared = _sampling(body.sampling, len(body.prompts))
        prompts = [_prompt(i, p, shared[i]) for i, p in enumerate(body.prompts)]
        batch = await self.client.submit(
            prompts,
            n=body.n,
            sampling=None if body.sampling is None else shared,  # type: ignore[arg-type]
            batch_id=body.batch_id,
            ids=body.ids,
            group_policy=body.group_policy,
        )
        log_event(log, logging.INFO, "submit", "batch submitted", batch_id=batch.batch_id,
                  rollouts=len(batch), group_size=batch.group_size)  # fmt: skip
        ids = list(batch)
        return reply(request, {"batch_id": batch.batch_id, "group_size": batch.group_size,
                               "ids": ids})  # fmt: skip

    # -- reads --------------------------------------------------------------------------------
    async def rollout(self, request: web.Request) -> web.Response:
        state = await self.client.store.load(_path_id(request, "rollout_id"))
        return reply(request, views.rollout(state))

    async def events(self, request: web.Request) -> web.Response:
        rid = _path_id(request, "rollout_id")
        events = await self.client.store.events(rid)
        if not events:
            raise RolloutNotFound(rid)
        return reply(request, {"rollout_id": rid, "events": [views.event(e) for e in events]})

    async def batch(self, request: web.Request) -> web.Response:
        info = await self.client.batch(_path_id(request, "batch_id"))
        return reply(request, views.batch(info))

    async def batches(self, request: web.Request) -> web.Response:
        return reply(request, {"batches": await self.client.batches()})

    async def session(self, request: web.Request) -> web.Response:
        session_id = _path_id(request, "session_id")
        return reply(request, views.session(session_id, await self.client.session(session_id)))

    async def trajectory(self, request: web.Request) -> web.Response:
        session_id = _path_id(request, "session_id")
        return reply(request, views.trajectory(await self.client.trajectory(session_id)))

    async def stats(self, request: web.Request) -> web.Response:
        stats, latest = await asyncio.gather(self.client.stats(), self.client.weights.latest())
        return reply(request, views.stats(stats, latest))

    # -- the result stream --------------------------------------------------------------------
    async def results(self, request: web.Request) -> web.StreamResponse:
        batch_id = _path_id(request, "batch_id")
        query_args = _single(request)
        if "take" in query_args:
            # It cancels the rest of the batch: not a GET, which retries and prefetchers
            # repeat at will. Named here, not refused as a mere unknown parameter.
            raise ApiError(
                422, "take_is_a_post",
                f"take cancels the rest of the batch, so it is not a GET: POST "
                f"/v1/batches/{batch_id}/take with {{\"groups\": k}}", "take",
            )  # fmt: skip
        try:
            query = schemas.ResultsQuery.model_validate(query_args)
        except ValidationError as exc:
            raise from_validation(exc) from None
        await self.client.batch(batch_id)  # 404 now, before the stream's 200 is sent
        # And a position that is none of the batch's results: 422 now, not an error line.
        await completions.check_position(
            self.client.redis, self.client.keys, batch_id, query.after or completions.START
        )
        results = self.client.results(
            batch_id, after=query.after or completions.START, timeout=query.timeout
        )
        return await _serve(request, results, batch_id)

    async def take(self, request: web.Request) -> web.StreamResponse:
        batch_id = _path_id(request, "batch_id")
        body = await parse(request, schemas.TakeRequest)
        await self.client.batch(batch_id)
        results = self.client.results(batch_id, take=body.groups, timeout=body.timeout)
        log_event(log, logging.INFO, "take", "taking the first groups of a batch",
                  batch_id=batch_id, groups=body.groups)  # fmt: skip
        return await _serve(request, results, batch_id)

    # -- writes -------------------------------------------------------------------------------
    async def cancel(self, request: web.Request) -> web.Response:
        body = await parse(request, schemas.CancelRequest)
        try:
            cancelled = await self.client.cancel(body.ids, batch_id=body.batch_id,
                                                 group=body.group, session=body.session,
                                                 reason=body.reason)  # fmt: skip
        except ValueError as exc:
            raise _documented(exc, "group") from None
        log_event(log, logging.INFO, "cancel", "rollouts cancelled", batch_id=body.batch_id,
                  session=body.session,
                  group=body.group, named=len(body.ids or ()),
                  cancelled=len(cancelled))  # fmt: skip
        return reply(request, {"cancelled": cancelled})

    async def ack(self, request: web.Request) -> web.Response:
        body = await parse(request, schemas.AckRequest)
        try:
            report = await self.client.ack(
                body.ids, batch_id=body.batch_id, group=body.group, session=body.session
            )
        except ValueError as exc:
            raise _documented(exc, "group") from None
        log_event(log, logging.INFO, "ack", "rollouts acknowledged", batch_id=body.batch_id,
                  session=body.session,
                  acked=len(report.acked), live=len(report.live),
                  missing=len(report.missing))  # fmt: skip
        return reply(request, views.ack(report))

    async def publish(self, request: web.Request) -> web.Response:
        body = await parse(request, schemas.PublishWeightsRequest)
        w = await self.client.publish_weights(body.version, body.path)
        log_event(log, logging.INFO, "publish_weights", "weights published", version=w.version)
        return reply(request, views.weight(w))

    # -- operations ---------------------------------------------------------------------------
    async def healthz(self, request: web.Request) -> web.Response:
        """Healthy when Redis answers and accepts writes; otherwise 503 with why (``reason``:
        unreachable, or the condition it refuses writes for, with a Retry-After)."""
        c = self.client
        try:
            refused = await asyncio.wait_for(writable.refusal(c.redis, c.keys), HEALTH_TIMEOUT_S)
        except Exception as exc:  # down, timed out or refused: unhealthy either way
            why = {"status": "unavailable", "redis": type(exc).__name__, "reason": "unreachable"}
            return reply(request, why, 503)
        if refused is not None:
            # It answers, but the trainer's submits and the workers' checkpoints are refused.
            why = {"status": "unavailable", "redis": str(refused), "reason": refused.refusal.value}
            response = reply(request, why, 503)
            response.headers["Retry-After"] = str(defaults.STORE_RETRY_AFTER_S)
            return response
        return reply(request, {"status": "ok", "redis": "ok"})

    async def metrics_text(self, request: web.Request) -> web.Response:
        c = self.client
        stats, latest, refused = await asyncio.gather(
            c.stats(), c.weights.latest(), writable.refusal(c.redis, c.keys)
        )
        # stats.now: Redis's clock (see store.stats).
        self.metrics.cluster.refresh(stats, latest, stats.now, refused)
        return web.Response(
            body=self.metrics.render(),
            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
        )


async def _serve(
    request: web.Request, results: AsyncIterator[RolloutResult], batch_id: str
) -> web.StreamResponse:
    """Stream ``results`` as NDJSON (or a msgpack sequence) once the checks have passed."""
    out = wire.wants_msgpack(request.headers.get("Accept", ""))
    response = web.StreamResponse(headers={"Content-Type": wire.MSGPACK if out else wire.NDJSON})
    await response.prepare(request)
    newline = b"" if out else b"\n"
    try:
        await _stream(response, results, out, newline, batch_id)
    except ConnectionResetError:
        # The consumer went away: nothing to tell it. It re-attaches with after=.
        return response
    finally:
        # Ends its blocked XREAD now rather than whenever the generator is collected.
        aclose = getattr(results, "aclose", None)
        if aclose is not None:
            await aclose()
    await response.write_eof()
    return response


async def _stream(
    response: web.StreamResponse,
    results: AsyncIterator[RolloutResult],
    out: bool,
    newline: bytes,
    batch_id: str,
) -> None:
    try:
        async for r in results:
            await response.write(wire.encode(views.result(r), out) + newline)
    except WaitTimeout as exc:
        # The status line has gone: the stream says why it ends in its last line.
        error = ApiError(504, "timeout", f"{exc}; re-attach with after=<last position>")
        await response.write(wire.encode(error.body(), out) + newline)
    except ConnectionResetError:
        raise
    except Exception as exc:
        known = from_exception(exc)
        if known is None:
            log.exception("result stream of batch %s failed", batch_id)
            known = ApiError(500, "internal", "internal error")
        await response.write(wire.encode(known.body(), out) + newline)


def _single(request: web.Request) -> dict[str, str]:
    query = request.query
    for key in query:
        if len(query.getall(key)) > 1:
            raise ApiError(422, "invalid_request", f"{key} given more than once", key)
    return dict(query)


def _documented(exc: ValueError, field: str) -> ApiError:
    """A named error keeps its status; a plain ValueError is the client's documented refusal
    of an argument (a group out of range)."""
    return from_exception(exc) or refused(exc, field)


def _sampling(
    sampling: schemas.Sampling | list[schemas.Sampling] | None, count: int
) -> list[SamplingParams | None]:
    if sampling is None:
        return [None] * count
    if isinstance(sampling, schemas.Sampling):
        return [_params(sampling, "sampling")] * count
    if len(sampling) != count:
        raise ApiError(
            422, "invalid_request", f"sampling: {len(sampling)} given for {count} prompts",
            "sampling",
        )  # fmt: skip
    return [_params(s, f"sampling.{i}") for i, s in enumerate(sampling)]


def _params(s: schemas.Sampling, where: str) -> SamplingParams:
    try:
        fields = s.model_dump()
        fields["stop"] = s.stop if isinstance(s.stop, str) else tuple(s.stop)
        fields["stop_token_ids"] = tuple(s.stop_token_ids)
        return SamplingParams(**fields)
    except InvalidRequest as exc:
        raise _at(where, exc) from None


def _prompt(
    i: int, p: schemas.Prompt | schemas.TokensPrompt, shared: SamplingParams | None
) -> Prompt:
    where = f"prompts.{i}"
    own = None if p.sampling is None else _params(p.sampling, f"{where}.sampling")
    sampling = shared or own
    episode = None if p.episode is None else _episode(p.episode, f"{where}.episode")
    try:
        chat = getattr(p, "messages", None)  # a TokensPrompt has none
        if chat is not None:
            messages: Sequence[dict[str, Any]] = [m.model_dump() for m in chat]
            return ChatRequest(messages=messages, sampling=sampling, metadata=p.metadata,
                               max_staleness=p.max_staleness, episode=episode)  # fmt: skip
        if sampling is None:
            raise ApiError(422, "invalid_request",
                           f"{where}.sampling: needed (here or in the body's sampling)",
                           f"{where}.sampling")  # fmt: skip
        return RolloutRequest(
            prompt_token_ids=tuple(p.prompt_token_ids or ()),
            sampling=sampling,
            metadata=p.metadata,
            max_staleness=p.max_staleness,
            episode=episode,
        )
    except InvalidRequest as exc:
        raise _at(where, exc) from None


def _episode(e: Episode, where: str) -> EpisodeSpec:
    """What the document cannot say (a tool named twice) the domain refuses, named."""
    try:
        return EpisodeSpec.from_dict(e.model_dump())
    except InvalidRequest as exc:
        raise _at(where, exc) from None


def _at(where: str, exc: InvalidRequest) -> ApiError:
    inner = _field_of(str(exc))
    return ApiError(422, "invalid_request", f"{where}: {exc}",
                    f"{where}.{inner}" if inner else where)  # fmt: skip
