"""The soak's audit (``bench/soak_audit.py``) catches what it is there to catch.

A clean log passes; the same log with a planted defect (a gap, a duplicate, a wrong token, a
renumbered event, an illegal transition, a snapshot out of step, a rollout that never ended)
fails the check named for it, and the run fails. Logs are built with the domain's own
commands, then mutated; the last tests store a log in Redis (fakeredis), damage it there and
read it back the way the soak does (``soak_trainer.capture``)."""

from __future__ import annotations

import dataclasses

import fakeredis
import numpy as np
import pytest
import redis.asyncio as aredis
import soak_audit as sa  # bench/ is on the path (tests/bench/conftest.py)
from soak_trainer import capture

from statemachine import (
    AbortReason,
    CorruptRecord,
    Event,
    FailureClass,
    FinishReason,
    RolloutRequest,
    RolloutState,
    SamplingParams,
    TokensAppended,
    commands,
    fold,
)
from statemachine.commands import NewTokens
from store import EventStore
from store.results import RolloutResult
from tests import fakeredis_xsetid  # noqa: F401  (XSETID, which lua/append.lua uses)

PROMPT = (11, 12, 13, 14)
N = 24
REF = sa.Reference(
    token_ids=(sum(PROMPT) + np.arange(N)).astype(np.int32),
    logprobs=(-(np.arange(N) % 7) / 10).astype(np.float32),
)


def tokens(start: int, end: int, version: int = 0) -> NewTokens:
    return NewTokens(
        token_ids=REF.token_ids[start:end],
        logprobs=REF.logprobs[start:end],
        weight_versions=np.full(end - start, version, np.int64),
    )


def clean_log(rid: str = "r0") -> list[Event]:
    """Submitted, Started, 8 tokens, aborted (worker lost) with 8 more, Resumed elsewhere, 8
    tokens, Finished: a rollout that lived through a takeover."""
    request = RolloutRequest(
        prompt_token_ids=PROMPT,
        sampling=SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True),
    )
    events: list[Event] = [commands.submit(rid, request)]

    def add(*new: Event) -> None:
        events.extend(new)

    def state() -> RolloutState | None:
        return fold(events)

    add(*commands.begin(state(), worker_id="a", weight_version=0, weight_mode="abort", model=""))
    add(commands.checkpoint(state(), tokens(0, 8)))
    add(
        *commands.abort(
            state(), AbortReason.WORKER_LOST, "lease of a expired", tokens=tokens(8, 16)
        )
    )
    add(*commands.begin(state(), worker_id="b", weight_version=1, weight_mode="abort", model=""))
    add(*commands.finish(state(), FinishReason.LENGTH, tokens=tokens(16, 24, version=1)))
    return events


def captured(events: list[Event], **changes: object) -> sa.Captured:
    """The rollout as the soak would read it: snapshot = the fold, result = what it says."""
    snap = fold(events)
    assert snap is not None
    c = sa.Captured(events[0].rollout_id, events, snap, RolloutResult.from_state(snap), REF)
    for name, value in changes.items():
        setattr(c, name, value)
    return c


def renumber(events: list[Event]) -> list[Event]:
    return [dataclasses.replace(e, seq=i) for i, e in enumerate(events, 1)]


def failing(c: sa.Captured) -> set[str]:
    return set(sa.check_rollout(c).problems)


def test_a_clean_log_passes_every_check() -> None:
    v = sa.check_rollout(captured(clean_log()))
    assert v.ok, v.problems
    assert (v.status, v.tokens_saved, v.tokens_lost) == ("done", N, 0)
    assert v.worker_lost == [(1, "a", "lease_expired")]
    audit = sa.Audit()
    audit.delivered("r0")
    audit.add(v)
    assert audit.passed, audit.summary()
    assert audit.budgets(killed={("r0", 1)}, stopped=set())["worker_lost_of"] == {"killed": 1}
    assert audit.passed


def test_a_worker_lost_charged_to_a_live_worker_fails_the_run() -> None:
    """Issue 28's lease clocks and presence checks: a worker judged lost while it was alive
    spends its rollout's budget for nothing. Only the attempts live on a worker when it was
    killed are its real losses: the same worker's earlier, false one is not excused by a
    later kill."""
    audit = sa.Audit()
    audit.add(sa.check_rollout(captured(clean_log())))
    figures = audit.budgets(killed={("r0", 2)}, stopped=set())  # attempt 2 (b), not 1 (a)
    assert figures["worker_lost_of"] == {"alive": 1}
    assert not audit.passed
    assert audit.checks[sa.NO_FALSE_LOSS].examples == ["r0: attempt 1 of a, alive (lease_expired)"]
    assert audit.budgets(killed=set(), stopped={("r0", 1)})["worker_lost_of"] == {"stopping": 1}
    assert audit.passed  # judged again: a stopping worker's loss is reported, not failed


def test_a_gap_in_the_offsets_is_caught() -> None:
    events = clean_log()
    chunk = next(i for i, e in enumerate(events) if isinstance(e, TokensAppended))
    gapped = renumber(events[:chunk] + events[chunk + 1 :])  # tokens 0..8 never written
    c = captured(events)  # the snapshot of the real history
    c.events = gapped
    assert {sa.OFFSETS, sa.FOLD} <= failing(c)
    assert "gap" in sa.check_rollout(c).problems[sa.OFFSETS]


def test_a_duplicated_chunk_is_caught() -> None:
    events = clean_log()
    chunk = next(i for i, e in enumerate(events) if isinstance(e, TokensAppended))
    doubled = renumber([*events[: chunk + 1], events[chunk], *events[chunk + 1 :]])
    c = captured(events)
    c.events = doubled
    problems = sa.check_rollout(c).problems
    assert "duplicate" in problems[sa.OFFSETS]
    assert sa.FOLD in problems


def test_a_renumbered_event_is_caught() -> None:
    events = clean_log()
    events[3] = dataclasses.replace(events[3], seq=9)
    c = captured(clean_log())
    c.events = events
    assert {sa.SEQ, sa.FOLD} <= failing(c)


def test_a_wrong_token_is_caught_against_the_uninterrupted_run() -> None:
    events = clean_log()
    i = next(i for i, e in enumerate(events) if isinstance(e, TokensAppended))
    e = events[i]
    assert isinstance(e, TokensAppended)
    wrong = e.token_ids.copy()
    wrong[3] += 1
    events[i] = dataclasses.replace(e, token_ids=wrong)
    # A consistent store that holds a wrong token: log, snapshot and result all agree.
    problems = sa.check_rollout(captured(events)).problems
    assert set(problems) == {sa.REFERENCE}
    assert "token 3" in problems[sa.REFERENCE]


def test_a_result_that_is_not_the_log_is_caught_and_counted_lost() -> None:
    events = clean_log()
    short = fold(events[:4])  # what the trainer was given: an older, shorter view
    assert short is not None
    v = sa.check_rollout(captured(events, result=RolloutResult.from_state(short)))
    assert set(v.problems) == {sa.RESULT}
    assert v.tokens_lost == N - short.num_tokens
    audit = sa.Audit()
    audit.add(v)
    assert not audit.passed
    assert audit.tokens_lost == {"result short of the log": N - short.num_tokens}


def test_a_snapshot_out_of_step_with_its_log_is_caught() -> None:
    events = clean_log()
    behind = fold(events[:-2])  # the head of a write that was lost
    c = captured(events, snapshot=behind)
    problems = sa.check_rollout(c).problems
    assert "snapshot differs from the fold" in problems[sa.FOLD]


def test_an_illegal_log_is_caught() -> None:
    """Issue 28's first defect: a takeover's Resumed written after its Aborted was refused
    (the log then ends ``TokensAppended att=1, Resumed att=2``)."""
    events = clean_log()[:3]  # Submitted, Started, TokensAppended
    stale = fold(events[:2])
    assert stale is not None
    [_, resumed] = commands.begin(
        stale, worker_id="z", weight_version=0, weight_mode="abort", model=""
    )
    events.append(dataclasses.replace(resumed, seq=4))
    c = captured(events[:3])
    c.events = events
    c.snapshot = CorruptRecord("snapshot counts 0 tokens, the log holds 8", rollout_id="r0", seq=4)
    c.result = RolloutResult.unreadable("r0", str(c.snapshot))  # what results() yields then
    v = sa.check_rollout(c)
    assert "illegal log" in v.problems[sa.FOLD]
    assert sa.LOG_READABLE in v.problems
    assert v.tokens_lost == 8 and v.log  # its saved tokens never reach the trainer; quoted
    assert v.log[-1].startswith("snapshot: CorruptRecord")


def test_a_stranded_rollout_fails_the_run() -> None:
    events = clean_log()[:3]  # started, 8 tokens saved, never ended
    v = sa.check_rollout(captured(events, result=None))
    assert v.ok  # its log is fine ...
    audit = sa.Audit()
    audit.add(v, stranded="stuck (no_job): aborted with 8 saved tokens and no rq job to run it")
    assert not audit.passed  # ... but it never ended, and its tokens never reached the trainer
    assert audit.checks[sa.ENDED].failures == 1
    assert audit.tokens_lost == {"never delivered": 8}
    gone = sa.Audit()
    gone.missing("r9", "no such rollout")
    assert not gone.passed and gone.checks[sa.ENDED].failures == 1


def test_a_failed_rollout_and_a_double_delivery_fail_the_run() -> None:
    events = clean_log()[:-1]
    state = fold(events)
    assert state is not None
    events.append(commands.fail(state, "5 workers were lost", FailureClass.WORKER_LOST))
    audit = sa.Audit()
    audit.add(sa.check_rollout(captured(events)))
    assert audit.checks[sa.NOT_FAILED].failures == 1 and audit.failures == {"worker_lost": 1}
    twice = sa.Audit()
    twice.delivered("r0")
    twice.delivered("r0")
    assert not twice.passed and twice.checks[sa.DELIVERED].failures == 1


@pytest.fixture
async def store() -> EventStore:
    return EventStore(fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer()))


async def stored(store: EventStore) -> list[Event]:
    events = clean_log("s0")
    state = None
    for e in events:
        state = await store.append(state, e)
    return events


async def test_a_clean_stored_log_reads_back_clean(store: EventStore) -> None:
    await stored(store)
    c = await capture(store, "s0")
    c.result, c.reference = RolloutResult.from_state(await store.load("s0")), REF
    assert sa.check_rollout(c).ok


async def test_an_entry_deleted_from_a_stored_log_is_caught(store: EventStore) -> None:
    await stored(store)
    redis: aredis.Redis = store.redis
    await redis.xdel(store.keys.log("s0"), "0-3")  # the first TokensAppended
    c = await capture(store, "s0")
    c.reference = REF
    v = sa.check_rollout(c)
    # load() refuses it (the snapshot counts tokens the log no longer holds) and the log
    # itself has a hole in its sequence and its offsets.
    assert {sa.LOG_READABLE, sa.SEQ, sa.OFFSETS, sa.FOLD} <= set(v.problems)


async def test_a_damaged_stored_record_is_caught(store: EventStore) -> None:
    await stored(store)
    redis: aredis.Redis = store.redis
    key = store.keys.log("s0")
    entries = await redis.xrange(key)
    await redis.delete(key)
    for entry_id, fields in entries:
        record = bytearray(fields[b"e"])
        if entry_id == b"0-3":
            record[-1] ^= 0xFF  # one flipped byte: the CRC refuses it
        await redis.xadd(key, {"e": bytes(record)}, id=entry_id)
    c = await capture(store, "s0")
    v = sa.check_rollout(c)
    assert "log does not decode" in v.problems[sa.LOG_READABLE]
    assert v.tokens_lost == N  # none of it can reach the trainer
