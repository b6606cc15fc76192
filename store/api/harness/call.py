"""One harness call is one batch: submit it under a key, wait for its rollouts, answer.

A harness (SkyRL, verifiers, an ``openai`` client) calls a vLLM-like endpoint and waits for
one complete answer. Here the handler records the call as a batch of ``n`` rollouts (one
prompt, ``n`` samples: a group) and answers from their results, so the call has every
guarantee a rollout has: a worker killed mid-call, a weight update or a Redis restart is
invisible to the caller except in the per-token weight versions.

Retries never generate twice. The batch id is derived from the call's key:

- an explicit key (the ``Idempotency-Key`` header, else the body's ``request_id``): a retry
  under it attaches to the same rollouts; the same key with another body is a 409 (the
  batch's recorded submission differs: ``BatchConflict``);
- else, when the call names a session (``X-Session-ID`` or the body's ``session_id``): the
  session and a hash of the body. SkyRL retries a dropped connection with the same body and
  session, and the ``openai`` client retries with the same body: such a retry attaches too.
  The price: two identical calls of one session are one call (sample twice with ``n``);
- else none: every call is new (a retry of an unkeyed, sessionless call generates again).

The API process itself may die mid-call: the rollouts keep generating, and the retry, on a
restarted API, attaches to them. A caller that goes away leaves its rollouts to finish and
expire by retention (``on_disconnect="cancel"`` cancels them instead).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from statemachine import RolloutRequest, Status
from store import defaults, sessions
from store.client import RolloutClient
from store.harness_turns import HarnessTurns
from store.results import RolloutResult
from store.turn_results import turn_result

from .served import ServedModel

T = TypeVar("T")


class Overloaded(Exception):
    """More calls wait on this API than ``--max-waiting`` allows; nothing was recorded."""

    def __init__(self, waiting: int) -> None:
        super().__init__(f"{waiting} calls are waiting on this API (--max-waiting); retry later")
        self.waiting = waiting


class CallerGone(ConnectionResetError):
    """The caller disconnected while its call ran: there is no one to answer. Its rollouts
    were left to finish (``keep``: a retry attaches to them) or cancelled (``cancel``)."""


class CallFailed(Exception):
    """A rollout of the call ended without an answer (failed or cancelled)."""

    def __init__(self, result: RolloutResult) -> None:
        why = result.error or (result.failure.value if result.failure else "")
        super().__init__(f"rollout {result.rollout_id} ended {result.status.value}: {why}")
        self.result = result


@dataclass(frozen=True, slots=True)
class Call:
    """A harness call, checked: what to generate, how many samples, and whose it is."""

    route: str  # the endpoint's name: keys of different endpoints never meet
    request: RolloutRequest
    n: int = 1
    key: str | None = None  # Idempotency-Key, else request_id
    session: str | None = None
    body: bytes = b""  # the raw body: with the session, the key of an unkeyed call

    def batch_id(self) -> str:
        """The batch the call is recorded as (see the module's docstring)."""
        if self.key is not None:
            basis = f"key\0{self.route}\0{self.key}".encode()
        elif self.session is not None:
            digest = hashlib.sha256(self.body).hexdigest()
            basis = f"session\0{self.route}\0{self.session}\0{digest}".encode()
        else:
            return f"call-{uuid.uuid4().hex}"
        return f"call-{hashlib.sha256(basis).hexdigest()[:32]}"


def session_metadata(call: Call) -> dict[str, Any]:
    """What the call's rollouts record of it: the session groups a trajectory's calls."""
    out: dict[str, Any] = {"call": call.route}
    if call.session is not None:
        out["session"] = call.session
    if call.key is not None:
        out["call_key"] = call.key
    return out


class Calls:
    """The calls one API serves: a bound on how many wait at once, and how each is run."""

    def __init__(
        self,
        client: RolloutClient,
        *,
        max_waiting: int = defaults.API_MAX_WAITING,
        on_disconnect: str = "keep",
        timeout_s: float = defaults.API_CALL_TIMEOUT_S,
        served: ServedModel | None = None,
    ) -> None:
        if on_disconnect not in defaults.ON_DISCONNECT:
            raise ValueError(f"on_disconnect must be one of {defaults.ON_DISCONNECT}")
        self.client = client
        self.max_waiting = max_waiting
        self.on_disconnect = on_disconnect
        self.timeout_s = timeout_s
        self.served = served or ServedModel()  # the model name and context harnesses read
        self.turns = HarnessTurns(client)  # a session's calls as turns of its episodes
        self.waiting = 0

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """One waiting call's place; ``Overloaded`` (before anything is recorded) when full."""
        if self.waiting >= self.max_waiting:
            raise Overloaded(self.waiting)
        self.waiting += 1
        try:
            yield
        finally:
            self.waiting -= 1

    async def run(
        self, call: Call, *, gone: Callable[[], bool] | None = None
    ) -> list[RolloutResult]:
        """Record the call (or attach to its earlier record) and wait for its ``n`` results,
        in sample order. ``gone``: whether the caller disconnected, polled while waiting:
        then the call stops waiting (``CallerGone``), which frees its place among the
        ``max_waiting``, and with ``on_disconnect="cancel"`` cancels its rollouts. Raises
        ``CallFailed`` for a rollout that ended without an answer, ``WaitTimeout`` past the
        call timeout."""
        if call.session is not None:  # ClusterUnsupported on a cluster, before anything
            sessions.refuse_on_cluster(self.client.redis)
        async with self.slot():
            meta = {**call.request.metadata, **session_metadata(call)}
            request = replace(call.request, metadata=meta)
            if call.session is not None and call.n == 1:
                return [await self._turn(call, request, gone)]
            batch = await self.client.submit(
                [request], n=call.n, batch_id=call.batch_id(), session=call.session
            )
            # The Batch itself: a fresh one is waited for without reading its heads first.
            results = await self._answer(
                self.client.wait(batch, timeout=self.timeout_s), gone, batch.batch_id,
                lambda: self.client.cancel(batch_id=batch.batch_id, reason="caller disconnected"),
            )  # fmt: skip
        for r in results:
            if r.status is not Status.DONE:
                raise CallFailed(r)
        return results

    async def _turn(
        self, call: Call, request: RolloutRequest, gone: Callable[[], bool] | None
    ) -> RolloutResult:
        """A session's call as a turn of its episode (``store.harness_turns``): recorded (or
        found, for a retry), waited for, and answered with the turn alone."""
        assert call.session is not None
        turn = await self.turns.begin(call.session, call.batch_id(), request)
        # Cancelled with the caller gone, the episode is the session's: its earlier turns go
        # with it, as the operator asked (``--on-disconnect cancel``).
        state = await self._answer(
            self.turns.wait(turn, self.timeout_s), gone, turn.batch_id,
            lambda: self.client.cancel([turn.rollout_id], reason="caller disconnected"),
        )  # fmt: skip
        full = RolloutResult.from_state(state)
        result = turn_result(full, turn.turn, turn.batch_id, self.client.tokenizer)
        if result.status is not Status.DONE:
            raise CallFailed(result)
        return result

    async def _answer(
        self,
        wait: Awaitable[T],
        gone: Callable[[], bool] | None,
        name: str,
        cancel: Callable[[], Awaitable[Any]],
    ) -> T:
        """What ``wait`` returns, unless the caller goes first (``gone``, polled): then the
        call stops waiting (``CallerGone``), which frees its place among the ``max_waiting``,
        and with ``on_disconnect="cancel"`` calls ``cancel``."""
        waiting = asyncio.ensure_future(wait)
        try:
            if gone is not None:
                await _until_done_or_gone(waiting, gone)
                if not waiting.done():
                    waiting.cancel()
                    if self.on_disconnect == "cancel":
                        await cancel()
                    raise CallerGone(f"the caller of {name} disconnected")
            return await waiting
        finally:
            if not waiting.done():
                waiting.cancel()


async def _until_done_or_gone(task: asyncio.Future[Any], gone: Callable[[], bool]) -> None:
    while not task.done():
        if gone():
            return
        await asyncio.wait([task], timeout=0.5)
