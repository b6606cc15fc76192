"""An episode's result as the trainer reads it: the whole context with its loss mask, turns,
tool calls (claims, outcomes, recovery's decisions) and routes present, read back from a real
EventStore on fakeredis and on a redis-server; a plain rollout's result as it was; groups of
episodes through ``RolloutClient.groups`` with both group policies (redis-server: the
completion stream is written by the append that ends each episode)."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from statemachine import FailureClass, FinishReason, Status, ToolEffect, ToolFailure
from store import EventStore
from store.client import RolloutClient
from store.environment import EnvironmentClient
from store.episode_results import CallOutcome, ClaimOutcome
from store.results import RolloutResult
from store.tool_sweep import sweep_lost_calls
from tests import factories as f
from tests.store.episode_play import Play, episode_request
from workers.failures import record_failure


class Joiner:
    """A tokenizer whose text shows every id it decoded, in order."""

    def decode(self, token_ids: list[int], **kwargs: Any) -> str:
        return " ".join(map(str, token_ids))


async def three_turns(store: EventStore, rid: str = "ep", **kw: Any) -> Play:
    """Turn 0: 3 tokens (v0), calc -> 2 observation tokens; turn 1: 4 tokens (v1), edit -> 3;
    turn 2: 2 tokens (v2), stop."""
    play = await Play.submit(store, rid, **kw.pop("request", {}))
    await play.turn(3, version=0, tool="calc", **kw)
    await play.claim()
    await play.result(2, seconds=0.5)
    await play.turn(4, version=1, tool="edit", **kw)
    await play.claim()
    await play.result(3, seconds=0.25)
    await play.last_turn(2, version=2, **kw)
    return play


async def test_three_turns_every_array_aligned_with_the_context(store: EventStore) -> None:
    await three_turns(store)
    r = RolloutResult.from_state(await store.load("ep"), Joiner())
    sampled = [100, 101, 102, 103, 104, 105, 106, 107, 108]
    ids = [100, 101, 102, 900, 901, 103, 104, 105, 106, 902, 903, 904, 107, 108]
    mask = [1, 1, 1, 0, 0, 1, 1, 1, 1, 0, 0, 0, 1, 1]
    assert r.response_token_ids.tolist() == ids
    assert r.loss_mask is not None and r.loss_mask.dtype == np.uint8
    assert r.loss_mask.tolist() == mask
    assert r.response_token_ids[r.loss_mask == 1].tolist() == sampled
    assert r.weight_versions.tolist() == [0, 0, 0, -1, -1, 1, 1, 1, 1, -1, -1, -1, 2, 2]
    # Each sampled token's logprob where it sits (-(offset+1)/100); 0.0 for an observation's.
    expected = np.zeros(len(ids), np.float32)
    expected[np.array(mask) == 1] = -(np.arange(9) + 1) / 100
    assert np.array_equal(r.logprobs, expected)
    assert r.turns == ((0, 3), (5, 9), (12, 14))
    assert [r.response_token_ids[s:e].tolist() for s, e in r.turns] == [
        [100, 101, 102], [103, 104, 105, 106], [107, 108]]  # fmt: skip
    assert r.version_segments == [(0, 0, 3), (1, 5, 9), (2, 12, 14)]  # no observation in one
    assert r.text == " ".join(map(str, ids))  # the whole context, decoded at once
    assert r.routed_experts is None and r.routes_present is None and r.top_token_ids is None
    assert (r.status, r.finish_reason, r.stale) == (Status.DONE, FinishReason.STOP, False)
    c1, c2 = r.tool_calls or ()
    assert (c1.name, c1.turn, c1.offset, c1.observation_tokens) == ("calc", 0, 3, 2)
    assert (c2.name, c2.turn, c2.offset, c2.observation_tokens) == ("edit", 1, 9, 3)
    for call in (c1, c2):  # each offset points at its own observation, just after its turn
        at = slice(call.offset, call.offset + call.observation_tokens)
        assert set(r.loss_mask[at].tolist()) == {0} and r.turns[call.turn][1] == call.offset
    assert r.response_token_ids[c2.offset : c2.offset + 3].tolist() == [902, 903, 904]
    assert (c1.outcome, c1.env_handle, c1.env_revision, c1.seconds) == (
        CallOutcome.RESULT, "box-1", "rev-1", 0.5)  # fmt: skip
    assert [(k.claim, k.runner_id, k.outcome, k.decision) for k in c1.claims] == [
        (1, "env1", ClaimOutcome.RESULT, None)]  # fmt: skip


async def test_top_k_rows_of_observation_tokens_are_zero(store: EventStore) -> None:
    await three_turns(store, request={"logprobs": 2}, top=2)
    r = RolloutResult.from_state(await store.load("ep"))
    assert r.top_token_ids is not None and r.top_logprobs is not None and r.loss_mask is not None
    assert r.top_token_ids.shape == (14, 2) and r.top_logprobs.shape == (14, 2)
    sampled = r.loss_mask == 1
    assert np.array_equal(r.top_token_ids[sampled][:, 0], r.response_token_ids[sampled])
    assert not r.top_token_ids[~sampled].any() and not r.top_logprobs[~sampled].any()


async def test_routes_present_for_sampled_rows_and_absent_for_unrecorded_observations(
    store: EventStore,
) -> None:
    await three_turns(store, routes=True)
    state = await store.load("ep")
    r = RolloutResult.from_state(state)
    assert r.routed_experts is not None and r.routes_present is not None and r.loss_mask is not None
    assert r.routed_experts.shape == (14, 2, 2) and r.routed_experts.dtype == np.uint8
    assert r.routes_present.dtype == np.bool_
    assert np.array_equal(r.routes_present, r.loss_mask == 1)
    # The sampled rows are the stored rows in order; the absent rows are zero.
    assert state.routed_experts is not None
    assert np.array_equal(r.routed_experts[r.routes_present], state.routed_experts)
    assert not r.routed_experts[~r.routes_present].any()
    assert r.routed_experts[5].tolist() == [[3, 4], [4, 5]]  # offset 3's row, after 2 obs


async def test_observation_rows_present_where_the_next_turn_recorded_its_prefill_routes(
    store: EventStore,
) -> None:
    """Turn 1 recorded its observation's routes (an engine that returns prompt routes); turn 2
    did not (one that returns none): those rows stay absent. Through the store: the v3 chunk
    is read back, from the snapshot's reader and from the log alike."""
    play = await Play.submit(store, "ep")
    await play.turn(3, routes=True)
    await play.claim()
    await play.result(2)
    await play.turn(4, version=1, tool="edit", routes=True, observed=True)
    await play.claim()
    await play.result(3)
    await play.last_turn(2, version=2, routes=True)
    state = await store.load("ep")
    assert state == await store.replay("ep")
    r = RolloutResult.from_state(state)
    assert r.routed_experts is not None and r.routes_present is not None and r.loss_mask is not None
    assert r.routes_present.tolist() == [True] * 9 + [False] * 3 + [True] * 2
    # The first observation's rows (ids 900, 901) as recorded, the sampled ones in place.
    obs = np.array([900, 901])[:, None, None] + np.arange(2)[:, None] + np.arange(2)
    assert r.routed_experts[3:5].tolist() == (obs % 8).tolist()
    assert np.array_equal(r.routed_experts[r.loss_mask == 1], state.routed_experts)
    assert not r.routed_experts[~r.routes_present].any()


async def test_a_lost_call_run_again_records_both_claims_and_the_decision(
    store: EventStore,
) -> None:
    play = await Play.submit(store, "ep")
    await play.turn(2, tool="calc")
    await play.claim("env1")
    await play.lose()  # idempotent: run again
    await play.claim("env2")
    await play.result(1, seconds=0.75)
    await play.turn(2, tool="edit")
    await play.claim("env2")
    await play.fail(ToolFailure.ENV_ERROR, "sandbox timed out", seconds=0.5)
    await play.claim("env3")
    await play.lose("lease of runner env3 expired")  # restore: restored, then run again
    await play.claim("env4")
    await play.result(2, seconds=0.125, revision="rev-b")
    await play.last_turn(1)
    r = RolloutResult.from_state(await store.load("ep"))
    c1, c2 = r.tool_calls or ()
    assert [(k.claim, k.runner_id, k.outcome, k.decision, k.seconds) for k in c1.claims] == [
        (1, "env1", ClaimOutcome.LOST, ToolEffect.IDEMPOTENT, 0.0),
        (2, "env2", ClaimOutcome.RESULT, None, 0.75),
    ]
    assert c1.claims[0].error == "lease of runner env1 expired" and c1.unverified == 1
    assert [(k.runner_id, k.outcome, k.decision) for k in c2.claims] == [
        ("env2", ClaimOutcome.ENV_ERROR, None),
        ("env3", ClaimOutcome.LOST, ToolEffect.RESTORE),
        ("env4", ClaimOutcome.RESULT, None),
    ]
    assert c2.claims[0].error == "sandbox timed out"
    assert c2.seconds == 0.625 and c2.env_revision == "rev-b"  # run time over all its claims
    assert all(k.ended_at is not None and k.ended_at >= k.claimed_at for k in c2.claims)
    assert (c1.outcome, c2.outcome, r.status) == (CallOutcome.RESULT, CallOutcome.RESULT,
                                                  Status.DONE)  # fmt: skip
    assert r.loss_mask is not None and r.loss_mask.tolist() == [1, 1, 0, 1, 1, 0, 0, 1]


async def test_an_effect_unverified_episode_fails_with_its_call_and_decision(
    store: EventStore,
) -> None:
    play = await Play.submit(store, "ep")
    await play.turn(3, tool="calc")
    await play.claim()
    await play.result(2)
    await play.turn(2, tool="send", args='{"to": "bob"}')
    await play.claim("env7")
    await play.lose("lease of runner env7 expired")  # restart: the episode fails
    r = RolloutResult.from_state(await store.load("ep"))
    assert (r.status, r.failure) == (Status.FAILED, FailureClass.EFFECT_UNVERIFIED)
    assert r.error is not None and "effect unverified" in r.error
    c1, c2 = r.tool_calls or ()
    assert (c2.name, c2.arguments, c2.outcome, c2.offset, c2.observation_tokens) == (
        "send", '{"to": "bob"}', CallOutcome.FAILED, 7, 0)  # fmt: skip
    [claim] = c2.claims
    assert (claim.runner_id, claim.outcome, claim.decision) == (
        "env7", ClaimOutcome.LOST, ToolEffect.RESTART)  # fmt: skip
    # What was generated and fed is all there: the failed turn's tokens end the context.
    assert r.response_token_ids.tolist() == [100, 101, 102, 900, 901, 103, 104]
    assert r.turns == ((0, 3), (5, 7)) and c1.outcome is CallOutcome.RESULT


async def test_pending_and_abandoned_calls(store: EventStore) -> None:
    play = await Play.submit(store, "ep")
    await play.turn(2, tool="calc")
    waiting = RolloutResult.from_state(await store.load("ep"))
    assert waiting.status is Status.AWAITING_TOOL
    assert [c.outcome for c in waiting.tool_calls or ()] == [CallOutcome.PENDING]
    assert waiting.turns == ((0, 2),)  # no turn after the call yet
    await play.claim()
    [call] = RolloutResult.from_state(await store.load("ep")).tool_calls or ()
    assert call.outcome is CallOutcome.PENDING and call.claims[0].outcome is None  # live
    await store.append(play.state, f.cancelled(play.state))
    [call] = RolloutResult.from_state(await store.load("ep")).tool_calls or ()
    assert call.outcome is CallOutcome.ABANDONED


async def test_an_env_fatal_failure_fails_the_call(store: EventStore) -> None:
    play = await Play.submit(store, "ep")
    await play.turn(2, tool="calc")
    await play.claim()
    await play.fail(ToolFailure.ENV_FATAL, "no such file")
    r = RolloutResult.from_state(await store.load("ep"))
    assert (r.status, r.failure) == (Status.FAILED, FailureClass.ENV_FATAL)
    [call] = r.tool_calls or ()
    assert call.outcome is CallOutcome.FAILED
    assert [(k.outcome, k.error) for k in call.claims] == [(ClaimOutcome.ENV_FATAL, "no such file")]


async def test_an_episode_without_a_call_still_has_its_fields(store: EventStore) -> None:
    play = await Play.submit(store, "ep")
    await play.last_turn(3)
    r = RolloutResult.from_state(await store.load("ep"))
    assert r.loss_mask is not None and r.loss_mask.tolist() == [1, 1, 1]
    assert (r.turns, r.tool_calls) == (((0, 3),), ())


async def test_a_plain_rollouts_result_is_what_it_was(store: EventStore) -> None:
    s = await store.append(None, f.submitted("plain", logprobs=2))
    s = await store.append(s, f.started(s))
    s = await store.append(s, f.tokens(s, n=3, routes=True))
    s = await store.append(s, f.finished(s))
    state = await store.load("plain")
    r = RolloutResult.from_state(state, Joiner())
    assert (r.loss_mask, r.turns, r.tool_calls, r.routes_present) == (None, None, None, None)
    # The very arrays the state derives, as before episodes existed.
    assert r.response_token_ids.tolist() == state.token_ids.tolist() == [100, 101, 102]
    assert r.routed_experts is not None and state.routed_experts is not None
    assert np.array_equal(r.routed_experts, state.routed_experts)
    assert np.array_equal(r.top_token_ids, state.top_token_ids)  # type: ignore[arg-type]
    assert r.text == "100 101 102" and r.version_segments == [(0, 0, 3)]


# -- groups of episodes through the trainer client (redis-server) ------------------------------
async def _play_to_the_end(store: EventStore, rid: str, turns: int) -> None:
    play = await Play.load(store, rid)
    for t in range(turns):
        await play.turn(2 + t, tool="calc")
        await play.claim()
        await play.result(1 + t)
    await play.last_turn(1)


async def test_a_group_of_episodes_is_delivered_whole(client: RolloutClient) -> None:
    batch = await client.submit([episode_request()], n=4, batch_id="grpo")
    reader = asyncio.create_task(_first_group(client, "grpo"))
    for i, rid in enumerate(batch):
        await _play_to_the_end(client.store, rid, turns=i + 1)
        await asyncio.sleep(0.02)
        assert not reader.done() or i == 3  # not before its last sample ends
    group = await asyncio.wait_for(reader, 10)
    assert group.complete and group.rollout_ids == list(batch)
    for i, r in enumerate(group.results):
        assert r.status is Status.DONE and len(r.tool_calls or ()) == i + 1
        assert r.turns is not None and len(r.turns) == i + 2 and r.loss_mask is not None
        observed = sum(c.observation_tokens for c in r.tool_calls or ())
        assert int((r.loss_mask == 0).sum()) == observed == sum(range(1, i + 2))


async def _first_group(client: RolloutClient, batch_id: str) -> Any:
    async for group in client.groups(batch_id):
        return group
    raise AssertionError("no group delivered")


@pytest.mark.parametrize("policy", ["sample", "group"])
async def test_a_failed_episode_and_its_group_policy(client: RolloutClient, policy: str) -> None:
    """Under ``group`` a failed episode cancels its siblings (mid-episode, their context so far
    kept) and the group is delivered at once; under ``sample`` they go on to the end."""
    batch = await client.submit([episode_request()], n=3, batch_id="g", group_policy=policy)
    first, *rest = batch
    for rid in rest:  # each sibling waits on its environment after one turn
        play = await Play.load(client.store, rid)
        await play.turn(2, tool="calc")
    failing = await Play.load(client.store, first)
    await failing.turn(2, tool="calc")
    await failing.claim()
    await failing.result(1)
    saved = await failing.turn_saves(3)
    # As a worker records a turn's failure: Failed, then the group policy.
    failed = await record_failure(client.store, saved, "engine died", FailureClass.ENGINE_ERROR)
    assert failed.status is Status.FAILED
    if policy == "sample":
        for rid in rest:
            play = await Play.load(client.store, rid)
            await play.claim()
            await play.result(2)
            await play.last_turn(1)
    group = await asyncio.wait_for(_first_group(client, "g"), 10)
    assert group.complete
    statuses = [r.status for r in group.results]
    siblings = Status.CANCELLED if policy == "group" else Status.DONE
    assert statuses == [Status.FAILED, siblings, siblings]
    failed, *others = group.results
    assert failed.loss_mask is not None and failed.loss_mask.tolist() == [1, 1, 0, 1, 1, 1]
    for r in others:
        [call] = r.tool_calls or ()
        expected = CallOutcome.ABANDONED if policy == "group" else CallOutcome.RESULT
        assert call.outcome is expected and r.turns is not None and r.turns[0] == (0, 2)


async def test_an_unverified_effect_under_the_group_policy_cancels_the_group(
    client: RolloutClient,
) -> None:
    """The sweep fails an episode whose ``restart`` tool lost its runner: under ``group`` its
    siblings are cancelled as for a worker's failure, and the group is delivered at once."""
    batch = await client.submit([episode_request()], n=3, batch_id="g", group_policy="group")
    first, *rest = batch
    for rid in rest:
        play = await Play.load(client.store, rid)
        await play.turn(2, tool="calc")
    lost = await Play.load(client.store, first)
    await lost.turn(2, tool="send")
    await lost.claim("env1", lease_s=0.05)
    await asyncio.sleep(0.15)  # the lease lapses by Redis's clock
    assert await sweep_lost_calls(client.store) == [first]
    group = await asyncio.wait_for(_first_group(client, "g"), 10)
    assert [r.status for r in group.results] == [Status.FAILED, Status.CANCELLED, Status.CANCELLED]
    failed = group.results[0]
    assert failed.failure is FailureClass.EFFECT_UNVERIFIED
    [call] = failed.tool_calls or ()
    assert call.claims[0].decision is ToolEffect.RESTART and call.outcome is CallOutcome.FAILED


async def test_an_environments_fatal_failure_under_the_group_policy_cancels_the_group(
    client: RolloutClient,
) -> None:
    """An environment's env_fatal report fails the episode; under ``group`` its siblings are
    cancelled as for any other failure, and the group is delivered at once."""
    batch = await client.submit([episode_request()], n=3, batch_id="g", group_policy="group")
    first, *rest = batch
    fatal = await Play.load(client.store, first)
    await fatal.turn(2, tool="calc")  # its call is the oldest on the queue: claimed first
    for rid in rest:
        play = await Play.load(client.store, rid)
        await play.turn(2, tool="calc")
    env = EnvironmentClient(client.store, client._queue.connection)
    claim = await env.claim("default", "env1")
    assert claim is not None and claim.rollout_id == first
    failed = await env.record_failure(claim, ToolFailure.ENV_FATAL, "sandbox gone")
    assert failed.status is Status.FAILED and failed.failure is FailureClass.ENV_FATAL
    group = await asyncio.wait_for(_first_group(client, "g"), 10)
    assert [r.status for r in group.results] == [Status.FAILED, Status.CANCELLED, Status.CANCELLED]
