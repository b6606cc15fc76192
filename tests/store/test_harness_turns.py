"""A harness's session as the turns of one episode (``store.harness_turns``), against a real
redis-server and a real worker (in-process, the synthetic engine): each call's answer is its
turn, equal to the engine run on the call's whole prompt; the episode stores each call's
added tokens once, not each call's whole prompt; retries find their turn, a key reused with
another body is refused; a call that does not extend the context starts a new episode and
ends the one it leaves; a crash between the call's index entry and its turn's record is
completed by the retry; the session's end and an idle session end the episode."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from statemachine import FinishReason, RolloutRequest, SamplingParams, Status
from statemachine.episode_events import TurnRequested
from store import defaults, sessions
from store.batches import BatchConflict
from store.client import RolloutClient
from store.harness_turns import HarnessTurns, fingerprint
from store.redis_server import RedisServer
from store.results import RolloutResult
from store.tool_sweep import sweep_wall_time
from store.turn_results import turn_result
from workers.engines.base import EngineRequest, join_chunks
from workers.engines.synthetic import SyntheticEngine
from workers.worker import Worker, WorkerConfig

pytestmark = pytest.mark.redis_server
SESSION = "s1"
SAMPLING = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture
async def client(redis_server: RedisServer, real_redis: object) -> AsyncIterator[RolloutClient]:
    c = RolloutClient(redis_server.url)
    worker = Worker(WorkerConfig(redis_url=redis_server.url, max_concurrency=4),
                    SyntheticEngine(tokens_per_chunk=2))  # fmt: skip
    running = asyncio.create_task(worker.run())
    yield c
    worker.request_stop()
    await asyncio.wait_for(running, 30)
    await c.aclose()


async def answer(turns: HarnessTurns, batch_id: str, prompt: tuple[int, ...]) -> RolloutResult:
    """One call of the session: its turn, waited for and read as its answer."""
    turn = await turns.begin(SESSION, batch_id, RolloutRequest(prompt_token_ids=prompt,
                                                               sampling=SAMPLING))  # fmt: skip
    state = await turns.wait(turn, timeout=60)
    return turn_result(RolloutResult.from_state(state), turn.turn, batch_id)


async def uninterrupted(prompt: tuple[int, ...]) -> list[int]:
    engine = SyntheticEngine()
    request = EngineRequest(request_id="ref", prompt_token_ids=prompt, sampling=SAMPLING)
    return join_chunks([c async for c in engine.generate(request)]).token_ids.tolist()


async def three_calls(turns: HarnessTurns) -> list[RolloutResult]:
    out, prompt = [], (5, 6, 7)
    for k in range(3):
        r = await answer(turns, f"call-{k}", prompt)
        out.append(r)
        prompt = (*prompt, *r.response_token_ids.tolist(), 900 + k, 901 + k)  # a tool result
    return out


async def test_a_sessions_calls_are_turns_of_one_episode_storing_only_new_tokens(
    client: RolloutClient,
) -> None:
    answers = await three_calls(HarnessTurns(client))
    assert len({r.rollout_id for r in answers}) == 1  # one rollout
    for r in answers:
        assert r.status is Status.DONE and r.finish_reason is FinishReason.LENGTH
        assert r.response_token_ids.tolist() == await uninterrupted(r.prompt_token_ids)
        assert set(r.weight_versions.tolist()) == {0}
    state = await client.store.load(answers[0].rollout_id)
    assert state.status is Status.AWAITING_TOOL and len(state.calls) == 3
    fed = [c.result for c in state.calls[:2]]
    assert all(isinstance(e, TurnRequested) for e in fed)
    assert [e.observation_token_ids.tolist() for e in fed] == [[900, 901], [901, 902]]  # type: ignore[union-attr]
    # What the log holds of prompts: the first call's, then each call's two added tokens:
    # 3 + 2 + 2 ids, where a rollout per call would have stored 3 + 11 + 19.
    events = await client.store.events(state.rollout_id)
    prompt_ids = len(events[0].request.prompt_token_ids)  # type: ignore[attr-defined]
    added = sum(len(e) for e in events if isinstance(e, TurnRequested))
    assert (prompt_ids, added) == (3, 4)
    # The session lists the three calls, each done, and reads as one trajectory.
    listed = await client.session(SESSION)
    assert [c.batch_id for c in listed] == ["call-0", "call-1", "call-2"]
    assert [c.statuses for c in listed] == [("done",)] * 3
    t = await client.trajectory(SESSION)
    [segment] = t.segments
    assert segment.loss_mask.tolist() == state.loss_mask.tolist()
    assert [c.batch_id for c in segment.calls] == ["call-0", "call-1", "call-2"]


async def test_retries_find_their_turn_and_a_reused_key_with_another_body_is_refused(
    client: RolloutClient,
) -> None:
    turns = HarnessTurns(client)
    first, second, _ = await three_calls(turns)
    seq = (await client.store.head(first.rollout_id)).seq
    again = await answer(turns, "call-1", second.prompt_token_ids)
    assert again.response_token_ids.tolist() == second.response_token_ids.tolist()
    again0 = await answer(turns, "call-0", first.prompt_token_ids)
    assert again0.response_token_ids.tolist() == first.response_token_ids.tolist()
    assert (await client.store.head(first.rollout_id)).seq == seq  # nothing written
    for batch_id in ("call-0", "call-1"):
        with pytest.raises(BatchConflict):
            await turns.begin(SESSION, batch_id, RolloutRequest(prompt_token_ids=(1, 2),
                                                                sampling=SAMPLING))  # fmt: skip


async def test_a_call_that_rewrites_history_starts_an_episode_and_ends_the_old_one(
    client: RolloutClient,
) -> None:
    turns = HarnessTurns(client)
    first = await answer(turns, "call-0", (5, 6, 7))
    other = await answer(turns, "call-1", (5, 6, 8, 1))  # not the first's context
    assert other.rollout_id != first.rollout_id
    old = await client.store.head(first.rollout_id)
    assert old.status is Status.DONE and old.finish_reason is FinishReason.SESSION_END
    t = await client.trajectory(SESSION)
    assert [s.start.value for s in t.segments] == ["first", "not_extended"]


async def test_a_retry_completes_a_turn_whose_record_a_crash_cut_short(
    client: RolloutClient,
) -> None:
    turns = HarnessTurns(client)
    first = await answer(turns, "call-0", (5, 6, 7))
    prompt = (5, 6, 7, *first.response_token_ids.tolist(), 42)
    request = RolloutRequest(prompt_token_ids=prompt, sampling=SAMPLING)
    # The call noted itself and its turn index entry, then its process died.
    entry = f"{first.rollout_id} 1 {fingerprint(request)}"
    await sessions.note_turn(client.redis, client.keys, SESSION, "call-1", entry, 0.0, 0)
    assert len((await client.store.head(first.rollout_id)).calls) == 1  # no turn recorded
    retried = await answer(turns, "call-1", prompt)
    assert retried.response_token_ids.tolist() == await uninterrupted(prompt)
    assert retried.rollout_id == first.rollout_id


async def test_the_sessions_end_and_an_idle_session_end_its_episode(
    client: RolloutClient,
) -> None:
    turns = HarnessTurns(client)
    first = await answer(turns, "call-0", (5, 6, 7))
    await turns.finish(SESSION)
    ended = await client.store.head(first.rollout_id)
    assert ended.status is Status.DONE and ended.finish_reason is FinishReason.SESSION_END
    # Another session, whose harness went away after its first call: the sweep ends it once
    # SESSION_IDLE_S passed since the turn ended, and not before.
    idle = await turns.begin("s2", "call-x", RolloutRequest(prompt_token_ids=(9, 9),
                                                            sampling=SAMPLING))  # fmt: skip
    state = await turns.wait(idle, timeout=60)
    ended_at = state.calls[-1].requested_at
    assert await sweep_wall_time(client.store, clock=lambda: ended_at + 60) == []
    later = ended_at + defaults.SESSION_IDLE_S + 1
    assert await sweep_wall_time(client.store, clock=lambda: later) == [idle.rollout_id]
    done = await client.store.head(idle.rollout_id)
    assert done.finish_reason is FinishReason.SESSION_END


async def test_acknowledging_the_session_ends_its_waiting_episode_and_deletes_it_all(
    client: RolloutClient,
) -> None:
    answers = await three_calls(HarnessTurns(client))
    rid = answers[0].rollout_id
    assert (await client.store.head(rid)).status is Status.AWAITING_TOOL
    report = await client.ack(session=SESSION)
    assert report.acked == [rid] and report.live == []
    keys = client.keys
    left = [keys.snapshot(rid), keys.log(rid), keys.session(SESSION), keys.session_turns(SESSION),
            keys.batch("call-0"), *(keys.completions(f"call-{k}") for k in range(3))]  # fmt: skip
    assert await client.redis.exists(*left) == 0
