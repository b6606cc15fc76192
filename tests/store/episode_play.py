"""An episode played through a real EventStore without a worker or a runner: the events a
generation worker and environment runners write (``commands``, ``episode_commands``), in the
order the test says, each appended as one atomic chain as the real ones do."""

from __future__ import annotations

from typing import Any

import numpy as np

from statemachine import (
    EpisodeSpec,
    FinishReason,
    RolloutRequest,
    RolloutState,
    SamplingParams,
    ToolEffect,
    ToolFailure,
    ToolSpec,
    commands,
    episode_commands,
)
from statemachine.commands import NewTokens
from store import EventStore

TOOLS = (
    ToolSpec(name="calc", effect=ToolEffect.IDEMPOTENT),
    ToolSpec(name="edit", effect=ToolEffect.RESTORE),
    ToolSpec(name="send", effect=ToolEffect.RESTART),
)


def episode_request(max_tokens: int = 64, logprobs: int = 0, **spec: Any) -> RolloutRequest:
    return RolloutRequest(
        prompt_token_ids=(1, 2, 3),
        sampling=SamplingParams(max_tokens=max_tokens, logprobs=logprobs),
        episode=EpisodeSpec(tool_call_stop_token_ids=(7,), tools=TOOLS, **spec),
    )


def sampled(
    state: RolloutState,
    n: int,
    version: int,
    *,
    routes: bool = False,
    top: int = 0,
    observed: bool = False,
) -> NewTokens:
    """``n`` tokens after the sampled ones so far: ids 100 + offset, logprob -(offset + 1)/100,
    routes ``[n, 2 layers, top-2]`` of (offset + layer + j) % 8; top-k ids id + j. ``observed``:
    with the last observation's routes, ``[m, 2, 2]`` of (observation id + layer + j) % 8 (the
    first tokens of the turn after a result)."""
    obs = None
    if observed:
        result = state.calls[-1].result
        assert result is not None
        ids = result.observation_token_ids.astype(np.int64)
        obs = ((ids[:, None, None] + np.arange(2)[:, None] + np.arange(2)) % 8).astype(np.uint8)
    at = np.arange(state.num_tokens, state.num_tokens + n)
    ids = (100 + at).astype(np.int32)
    return NewTokens(
        token_ids=ids,
        logprobs=(-(at + 1) / 100).astype(np.float32),
        weight_versions=np.full(n, version, np.int64),
        routed_experts=((at[:, None, None] + np.arange(2)[:, None] + np.arange(2)) % 8).astype(
            np.uint8
        )
        if routes
        else None,
        top_token_ids=(ids[:, None] + np.arange(top, dtype=np.int32)) if top else None,
        top_logprobs=-np.tile(np.arange(1, top + 1, dtype=np.float32), (n, 1)) if top else None,
        observation_routes=obs,
    )


class Play:
    """One episode's events, appended to ``store`` as a worker and runners would."""

    def __init__(self, store: EventStore, state: RolloutState) -> None:
        self.store = store
        self.state = state

    @classmethod
    async def submit(cls, store: EventStore, rid: str, **request: Any) -> Play:
        first = commands.submit(rid, episode_request(**request))
        return cls(store, await store.append(None, first))

    @classmethod
    async def load(cls, store: EventStore, rid: str) -> Play:
        return cls(store, await store.load(rid))

    async def _chain(self, events: list[Any]) -> RolloutState:
        self.state = await self.store.append_chain(self.state, events)
        return self.state

    async def turn(
        self, n: int, *, version: int = 0, tool: str = "calc", args: str = '{"x": 1}',
        routes: bool = False, top: int = 0, worker: str = "w1", observed: bool = False,
    ) -> RolloutState:  # fmt: skip
        """A worker's turn of ``n`` tokens that ends at a call of ``tool``."""
        await self._begin(worker, version)
        tokens = sampled(self.state, n, version, routes=routes, top=top, observed=observed)
        return await self._chain(
            episode_commands.request_call(self.state, name=tool, arguments=args, tokens=tokens)
        )

    async def last_turn(
        self, n: int, *, version: int = 0, routes: bool = False, top: int = 0,
        reason: FinishReason = FinishReason.STOP, worker: str = "w1", observed: bool = False,
    ) -> RolloutState:  # fmt: skip
        """A worker's turn of ``n`` tokens that ends the episode (``reason``)."""
        await self._begin(worker, version)
        tokens = sampled(self.state, n, version, routes=routes, top=top, observed=observed)
        return await self._chain(commands.finish(self.state, reason, tokens=tokens))

    async def turn_saves(self, n: int) -> RolloutState:
        """A worker's turn that has saved ``n`` tokens so far (and goes on)."""
        await self._begin("w1", 0)
        return await self._chain([commands.checkpoint(self.state, sampled(self.state, n, 0))])

    async def _begin(self, worker: str, version: int) -> None:
        await self._chain(commands.begin(self.state, worker_id=worker, weight_version=version,
                                         weight_mode="abort", model="m"))  # fmt: skip

    async def claim(self, runner: str = "env1", lease_s: float | None = None) -> int:
        """``runner`` claims the pending call; with ``lease_s``, leased as an
        ``EnvironmentClient`` claim is (so the sweep finds it once the lease lapses)."""
        claimed = episode_commands.claim_call(self.state, runner)
        self.state = await self.store.append_chain(self.state, [claimed], tool_lease_s=lease_s)
        call = self.state.pending_call
        assert call is not None
        return call.live_claim

    def _live(self) -> tuple[str, int]:
        call = self.state.pending_call
        assert call is not None and call.live_claim
        return call.call_id, call.live_claim

    async def result(self, n: int, *, seconds: float = 0.25, revision: str = "") -> RolloutState:
        """The live claim's result: ``n`` observation tokens 900 + (observation tokens so far)."""
        call_id, claim = self._live()
        start = 900 + self.state.observation_tokens
        return await self._chain(episode_commands.record_result(
            self.state, call_id=call_id, claim=claim, seconds=seconds, env_handle="box-1",
            env_revision=revision or f"rev-{len(self.state.calls)}",
            observation_token_ids=np.arange(start, start + n, dtype=np.int32),
        ))  # fmt: skip

    async def fail(
        self, failure: ToolFailure, error: str = "timed out", seconds: float = 0.5
    ) -> RolloutState:
        call_id, claim = self._live()
        return await self._chain(episode_commands.fail_call(
            self.state, call_id=call_id, claim=claim, failure=failure, error=error, retries=1,
            seconds=seconds,
        ))  # fmt: skip

    async def lose(self, detail: str = "lease of runner env1 expired") -> RolloutState:
        call_id, claim = self._live()
        return await self._chain(
            episode_commands.lose_call(self.state, call_id=call_id, claim=claim, detail=detail)
        )
