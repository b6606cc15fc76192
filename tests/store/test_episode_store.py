"""Episodes in the store: a loaded episode is the fold of its log at every state (on fakeredis
and a real redis-server), its calls included, and a plain rollout's read costs what it did."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from statemachine import Event, RolloutState, apply
from statemachine.errors import InvalidRequest
from statemachine.events import Cancelled
from statemachine.status import Status
from store import EventStore
from store.errors import SequenceConflict
from tests import factories as f

Step = Callable[[RolloutState], Event]


def _episode_steps() -> list[Step]:
    """Every episode state, and every claim ending: a failed retry, a result, a lost claim
    of a ``restore`` tool, a result, and a budget-free finish."""
    return [
        f.started,
        lambda s: f.tokens(s, n=3),
        lambda s: f.requested(s, "calc"),
        f.claimed,
        f.call_failed,
        lambda s: f.claimed(s, runner="env2"),
        lambda s: f.result(s, n=2),
        f.resumed,
        lambda s: f.tokens(s, n=2),
        lambda s: f.requested(s, "edit"),
        f.claimed,
        f.call_lost,
        lambda s: f.claimed(s, runner="env3"),
        lambda s: f.result(s, n=4),
        f.resumed,
        f.tokens,
        f.finished,
    ]


def _same(a: RolloutState, b: RolloutState, *, chunks: bool = True) -> None:
    assert a.seq == b.seq and a.status is b.status
    assert a.calls == b.calls
    if chunks:
        assert a == b


async def test_a_loaded_episode_is_the_fold_of_its_log_at_every_state(store: EventStore) -> None:
    state: RolloutState | None = None
    sub = f.episode_submitted("ep")
    state = await store.append(None, sub)
    folded = apply(None, sub)
    seen = {state.status}
    for step in _episode_steps():
        event = step(state)
        state = await store.append(state, event)
        folded = apply(folded, event)
        seen.add(state.status)
        loaded = await store.load("ep")
        _same(loaded, folded)
        _same(await store.replay("ep"), folded)
        [many] = await store.load_many(["ep"])
        assert isinstance(many, RolloutState)
        _same(many, folded)
        _same(await store.head("ep"), folded, chunks=False)
    assert {Status.AWAITING_TOOL, Status.RUNNING_TOOL, Status.NEXT_TURN, Status.DONE} <= seen
    assert len(folded.calls) == 2 and folded.calls[1].unverified == 1


async def test_head_reads_an_episode_log_once_more_and_a_plain_rollout_never(
    store: EventStore, monkeypatch: Any
) -> None:
    plain = await store.append(None, f.submitted("plain"))
    plain = await store.append(plain, f.started(plain))
    episode = await store.append(None, f.episode_submitted("ep"))
    episode = await store.append(episode, f.started(episode))
    episode = await store.append(episode, f.requested(episode))
    reads: list[str] = []
    xrange = store.redis.xrange

    async def counted(key: Any, *args: Any, **kw: Any) -> Any:
        reads.append(key)
        return await xrange(key, *args, **kw)

    monkeypatch.setattr(store.redis, "xrange", counted)
    assert (await store.head("plain")).status is Status.GENERATING
    assert reads == []  # the one pipelined read of snapshot and Submitted record, as before
    head = await store.head("ep")
    assert [c.call_id for c in head.calls] == ["c1"] and head.status is Status.AWAITING_TOOL
    assert reads == [store.keys.log("ep")]


async def test_a_cancelled_episode_leaves_its_environment_queue(store: EventStore) -> None:
    s = await store.append(None, f.episode_submitted("ep", env_queue="box"))
    s = await store.append(s, f.started(s))
    s = await store.append(s, f.requested(s))
    queue = store.keys.env_queue("box")
    assert await store.redis.zrange(queue, 0, -1) == [b"ep"]
    await store.append(s, Cancelled(rollout_id="ep", seq=s.seq + 1, reason="trainer"))
    assert await store.redis.zrange(queue, 0, -1) == []


async def test_a_refused_append_leaves_the_queue_to_the_event_that_won(store: EventStore) -> None:
    s = await store.append(None, f.episode_submitted("ep"))
    s = await store.append(s, f.started(s))
    waiting = await store.append(s, f.requested(s))
    claimed = await store.append(waiting, f.claimed(waiting, runner="a"))
    queue = store.keys.env_queue("default")
    assert await store.redis.zrange(queue, 0, -1) == []
    # A second runner's claim from the same view is refused and changes no index.
    with pytest.raises(SequenceConflict):
        await store.append(waiting, f.claimed(waiting, runner="b"))
    assert await store.redis.zrange(queue, 0, -1) == []
    assert await store.redis.hget(store.keys.snapshot("ep"), "tc") == b"1 c1"  # claim 1 of c1
    assert (await store.load("ep")).calls[0].claims[-1].runner_id == "a"
    assert claimed.status is Status.RUNNING_TOOL


def test_an_env_queue_name_follows_the_stores_id_rules_exactly() -> None:
    """A queue name the domain accepts is one the store can name a key with: else a submit
    took an episode whose worker's append was refused mid-episode."""
    from statemachine.episode import ENV_QUEUE_CHARS, MAX_ENV_QUEUE_LEN
    from store.keys import ID_CHARS, MAX_BATCH_ID_LEN, Keys

    assert ENV_QUEUE_CHARS == ID_CHARS and MAX_ENV_QUEUE_LEN == MAX_BATCH_ID_LEN
    for bad in ("a\ufeffb", "a\u2028b", "a b", "a:b", "{a}", "a\x85"):
        with pytest.raises(InvalidRequest, match="env_queue"):
            f.episode(env_queue=bad)
    assert Keys().env_queue(f.episode(env_queue="sandbox-é").env_queue)
