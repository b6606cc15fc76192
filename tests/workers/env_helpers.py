"""Episodes put where an environment runner finds them, without a generation worker: the
events a worker would append (as tests/store/test_environment.py does), the call's arguments
as a worker records them (``{"token_ids": [...]}``)."""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np

from examples.calculator import NAME, episode_spec
from statemachine import RolloutState
from statemachine.episode import EpisodeSpec, ToolEffect, ToolSpec
from statemachine.events import Submitted
from statemachine.request import RolloutRequest, SamplingParams
from store import EventStore
from store.environment import EnvironmentClient
from tests import factories as f

TURN = (41, 42, 43, 7)  # a turn's sampled tokens, its stop token (7) last


async def awaiting_call(
    store: EventStore,
    rid: str = "ep",
    *,
    tool: str = NAME,
    effect: ToolEffect = ToolEffect.IDEMPOTENT,
    token_ids: Sequence[int] = TURN,
    arguments: str | None = None,
) -> RolloutState:
    """An episode whose first turn ended at a call of ``tool`` (declared ``effect``)."""
    spec = (
        episode_spec([7], effect=effect)
        if tool == NAME
        else EpisodeSpec(tool_call_stop_token_ids=(7,), tools=(ToolSpec(name=tool, effect=effect),))
    )
    request = RolloutRequest(
        prompt_token_ids=(1, 2, 3), sampling=SamplingParams(max_tokens=64), episode=spec
    )
    s = await store.append(None, Submitted(rollout_id=rid, seq=1, request=request))
    s = await store.append(s, f.started(s))
    return await next_call(store, s, token_ids, arguments, tool)


async def next_call(
    store: EventStore,
    s: RolloutState,
    token_ids: Sequence[int] = TURN,
    arguments: str | None = None,
    tool: str = NAME,
) -> RolloutState:
    """The live attempt of ``s`` samples ``token_ids`` and ends its turn at a call."""
    s = await store.append(s, f.tokens(s, list(token_ids)))
    args = json.dumps({"token_ids": list(token_ids)}) if arguments is None else arguments
    return await store.append(s, f.requested(s, tool, arguments=args))


async def second_turn(env: EnvironmentClient, rid: str = "ep", revision: str = "rev-1") -> None:
    """The first call's result recorded (``revision``) and a second turn ending at a call, as
    a runner and a worker would: the input of the restore path."""
    claim = await env.claim("default", "first-runner")
    assert claim is not None
    obs = np.array([10, 11, 12, 13], dtype=np.int32)
    await env.record_result(claim, obs, env_handle=NAME, env_revision=revision)
    s = await env.store.head(rid)
    s = await env.store.append(s, f.resumed(s))
    await next_call(env.store, s, (51, 52, 7))
