"""The environment routes: whoever runs an episode's tools, in another process or language,
claims the pending calls of an environment queue, heartbeats them, and records each one's
result or failure over HTTP.

Each handler is one call of the API process's ``store.environment.EnvironmentClient``, whose
fence decides: a report under a claim that is not the call's live one any more (its lease
lapsed and the call was claimed again, or its episode ended) is refused 409 ``claim_lost``
with nothing written. A report about a rollout that does not exist is a 404 instead.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np
from aiohttp import web

from statemachine import RolloutState, ToolFailure
from store.environment import EnvironmentClient, ToolCallClaim
from store.errors import ClaimLost, InvalidRolloutId
from store.keys import MAX_BATCH_ID_LEN, MAX_ID_LEN, check_batch_id, check_rollout_id
from store.logs import log_event

from . import env_schemas as s
from .errors import ApiError
from .handlers import parse, reply
from .harness.call import CallerGone
from .route import Route

log = logging.getLogger("rollouts.api")
_BODY_ERRORS = (400, 413, 422)
_CALL = "/v1/env/calls/{rollout_id}/{call_id}"

ROUTES: tuple[Route, ...] = (
    Route("POST", "/v1/env/{queue}/claim", "env_claim",
          "Claim the oldest pending tool call of environment queue `queue` for a runner, "
          "leased (EnvironmentClient.claim); waits up to timeout_s for one",
          s.ClaimRequest, s.ToolCall, (*_BODY_ERRORS, 503),
          empty="No call came within timeout_s"),
    Route("POST", f"{_CALL}/heartbeat", "env_heartbeat",
          "Renew a claim's lease; 409 claim_lost once it is not the call's live claim (stop "
          "running the call: another runner may have it)",
          s.HeartbeatRequest, s.Heartbeat, (*_BODY_ERRORS, 404, 409, 503)),
    Route("POST", f"{_CALL}/result", "env_result",
          "Record the claim's result (its observation tokens): the episode's next turn is "
          "queued, unless a budget ends it; 409 claim_lost (nothing written) for a claim "
          "that is not live",
          s.ResultRequest, s.EpisodeAfter, (*_BODY_ERRORS, 404, 409, 503)),
    Route("POST", f"{_CALL}/failure", "env_failure",
          "Record that the claim failed: env_error (claimable again within the retries) or "
          "env_fatal (the episode fails); 409 claim_lost (nothing written) for a claim that "
          "is not live",
          s.FailureRequest, s.EpisodeAfter, (*_BODY_ERRORS, 404, 409, 503)),
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Fence:
    """The call and claim a report names (``store.environment.CallFence``)."""

    rollout_id: str
    call_id: str
    claim: int


class Handlers:
    def __init__(self, env: EnvironmentClient) -> None:
        self.env = env

    async def env_claim(self, request: web.Request) -> web.StreamResponse:
        queue = _queue(request)
        body = await parse(request, s.ClaimRequest)
        lease_s = body.lease_s or self.env.lease_s
        deadline = time.monotonic() + body.timeout_s
        first: str | None = None
        while True:
            # A claim for a runner that went away would hold the call until its lease
            # lapses, and then count as a lost runner (effect unverified): look first.
            if request.transport is None or request.transport.is_closing():
                raise CallerGone(f"runner {body.runner_id} left its claim on {queue}")
            got = await self.env.claim(queue, body.runner_id, lease_s, first=first)
            left = deadline - time.monotonic()
            if got is not None or left <= 0:
                break
            rung = await self.env.wait([queue], left)  # its doorbell, or TOOL_CLAIM_POLL_S
            first = None if rung is None else rung[1]
        if got is None:
            return web.Response(status=204)
        log_event(log, logging.DEBUG, "env_claim", "tool call claimed", rollout_id=got.rollout_id,
                  call_id=got.call_id, claim=got.claim, runner=got.runner_id)  # fmt: skip
        return reply(request, _claimed(got, lease_s))

    async def env_heartbeat(self, request: web.Request) -> web.Response:
        call = _call(request)
        body = await parse(request, s.HeartbeatRequest)
        fence = Fence(*call, body.claim)
        [live] = await self.env.heartbeat([fence], body.lease_s)
        if not live:
            await self._known(fence.rollout_id)
            raise _lost(fence, "not the call's live claim (its lease lapsed, or the call ended)")
        lease_s = body.lease_s or self.env.lease_s
        return reply(request, {"rollout_id": fence.rollout_id, "call_id": fence.call_id,
                               "claim": fence.claim, "lease_s": lease_s})  # fmt: skip

    async def env_result(self, request: web.Request) -> web.Response:
        call = _call(request)
        body = await parse(request, s.ResultRequest)
        fence = Fence(*call, body.claim)
        ids = np.asarray(body.observation_token_ids, dtype=np.int32)  # in range: the schema
        try:
            after = await self.env.record_result(fence, ids, env_handle=body.env_handle,
                                                 env_revision=body.env_revision,
                                                 seconds=body.seconds)  # fmt: skip
        except ClaimLost as exc:
            await self._refused(fence, exc)
        log_event(log, logging.DEBUG, "env_result", "tool result recorded",
                  rollout_id=fence.rollout_id, call_id=fence.call_id, claim=fence.claim,
                  observation=len(ids), status=after.status.value)  # fmt: skip
        return reply(request, _after(after, fence))

    async def env_failure(self, request: web.Request) -> web.Response:
        call = _call(request)
        body = await parse(request, s.FailureRequest)
        fence = Fence(*call, body.claim)
        try:
            after = await self.env.record_failure(
                fence, ToolFailure(body.failure), body.error, body.seconds
            )
        except ClaimLost as exc:
            await self._refused(fence, exc)
        log_event(log, logging.INFO, "env_failure", "tool call failed",
                  rollout_id=fence.rollout_id, call_id=fence.call_id, claim=fence.claim,
                  failure=body.failure, status=after.status.value)  # fmt: skip
        return reply(request, _after(after, fence))

    async def _refused(self, fence: Fence, exc: ClaimLost) -> NoReturn:
        """A refused report: 404 if its rollout does not exist, else the 409 it is."""
        await self._known(fence.rollout_id)
        log_event(log, logging.INFO, "claim_lost", "a report under a lost claim refused",
                  rollout_id=fence.rollout_id, call_id=fence.call_id,
                  claim=fence.claim)  # fmt: skip
        raise exc

    async def _known(self, rollout_id: str) -> None:
        await self.env.store.head(rollout_id)  # RolloutNotFound: a 404


def handlers(env: EnvironmentClient) -> dict[str, Any]:
    """Route name -> its handler."""
    served = Handlers(env)
    return {r.name: getattr(served, r.name) for r in ROUTES}


def _queue(request: web.Request) -> str:
    try:
        return check_batch_id(request.match_info["queue"])  # an env queue's rules (Keys)
    except InvalidRolloutId:
        raise _invalid("queue", MAX_BATCH_ID_LEN) from None


def _call(request: web.Request) -> tuple[str, str]:
    """The path's rollout and call (the claim comes with the body)."""
    out = []
    for name in ("rollout_id", "call_id"):
        try:
            out.append(check_rollout_id(request.match_info[name]))
        except InvalidRolloutId:
            raise _invalid(name, MAX_ID_LEN) from None
    return out[0], out[1]


def _invalid(name: str, most: int) -> ApiError:
    words = name.replace("_", " ")
    return ApiError(422, "invalid_id", f"{words} must be 1-{most} characters without braces, "
                    "colons, whitespace or control characters", name)  # fmt: skip


def _lost(fence: Fence, why: str) -> ClaimLost:
    return ClaimLost(fence.rollout_id, fence.call_id, fence.claim, why)


def _claimed(c: ToolCallClaim, lease_s: float) -> dict[str, Any]:
    return {"rollout_id": c.rollout_id, "call_id": c.call_id, "claim": c.claim,
            "runner_id": c.runner_id, "name": c.name, "arguments": c.arguments,
            "idempotency_key": c.idempotency_key, "effect": c.effect.value,
            "env_handle": c.env_handle, "env_revision": c.env_revision, "restore": c.restore,
            "lease_s": lease_s}  # fmt: skip


def _after(state: RolloutState, fence: Fence) -> dict[str, Any]:
    return {
        "rollout_id": state.rollout_id,
        "call_id": fence.call_id,
        "status": state.status.value,
        "finish_reason": None if state.finish_reason is None else state.finish_reason.value,
        "failure": None if state.failure is None else state.failure.value,
        "error": state.error,
    }
