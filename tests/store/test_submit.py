"""Submitting: batches and groups, idempotency, nothing stranded, nothing written when refused.

On a real redis-server: the client's submit is a MULTI/EXEC of Lua appends and rq's own
enqueue commands, which is what these tests are about."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
import redis.asyncio as aredis
from rq import Queue

from statemachine import (
    GroupPolicy,
    InvalidRequest,
    Membership,
    RolloutRequest,
    SamplingParams,
    Status,
)
from store import InvalidRolloutId, RolloutExists, batches, defaults
from store.client import BatchConflict, RolloutClient
from store.redis_server import RedisServer
from store.submission import ChatRequest
from tests import factories as f
from tests.store.held import MAX_CALL_S, RedisCpu
from tests.store.trainer import dump


def queued(client: RolloutClient) -> list[str]:
    """The rollout ids of the jobs waiting in the client's queue, in queue order."""
    q: Queue = client._queue
    return [job.kwargs["rollout_id"] for job in q.get_jobs()]


async def test_a_retried_submit_with_named_ids_returns_them_and_enqueues_nothing_new(
    client: RolloutClient,
) -> None:
    # Issue 13 (a): the old submit stamped a new time into each retry's record, so the
    # retry's append conflicted and raised RolloutExists.
    r = f.request()
    first = await client.submit([r], ids=["x"])
    again = await client.submit([r], ids=["x"])
    assert list(first) == list(again) == ["x"]
    assert first.batch_id == again.batch_id
    assert queued(client) == ["x"]
    assert await client.statuses(["x"]) == ["pending"]


async def test_an_existing_id_refuses_the_whole_submit_and_writes_nothing(
    client: RolloutClient, real_redis: aredis.Redis
) -> None:
    # Issue 13 (b): the old submit wrote n1 and n2 as pending, then raised before enqueueing
    # them: pending forever, with no job.
    await client.submit([f.request(max_tokens=5)], ids=["x"])
    before = await dump(real_redis)
    with pytest.raises(RolloutExists, match="'x'"):
        await client.submit([f.request()] * 3, ids=["n1", "x", "n2"])
    assert await dump(real_redis) == before
    assert queued(client) == ["x"]


async def test_a_rollout_is_the_same_only_in_the_same_place_of_the_same_batch(
    client: RolloutClient,
) -> None:
    r = f.request()
    await client.submit([r], ids=["x"], batch_id="b1")
    # x again, with the same request, in a grown submission: under b1 that is another
    # submission than the recorded one; under b2, x would be the second prompt of another
    # batch, which is another rollout than the one recorded. Both refused.
    with pytest.raises(BatchConflict):
        await client.submit([r] * 3, ids=["n1", "x", "n2"], batch_id="b1")
    with pytest.raises(RolloutExists):
        await client.submit([r] * 3, ids=["n1", "x", "n2"], batch_id="b2")
    # The same ids and requests under the first batch id, in the same places: a retry.
    await client.submit([r], ids=["x"], batch_id="b1")
    # A different submission under a recorded batch id, with new ids: refused by the batch.
    with pytest.raises(BatchConflict):
        await client.submit([r], ids=["y"], batch_id="b1")
    assert queued(client) == ["x"]


async def test_a_duplicate_id_within_one_call_is_refused(
    client: RolloutClient, real_redis: aredis.Redis
) -> None:
    before = await dump(real_redis)
    with pytest.raises(InvalidRequest, match="more than once"):
        await client.submit([f.request()] * 2, ids=["d", "d"])
    assert await dump(real_redis) == before


async def test_groups_are_recorded_with_their_batch_and_sample(client: RolloutClient) -> None:
    prompts = [f.request(prompt=(1, 2)), f.request(prompt=(3, 4, 5))]
    batch = await client.submit(prompts, n=3, batch_id="step-1", group_policy="group")
    assert list(batch) == [f"step-1.{g}.{s}" for g in range(2) for s in range(3)]
    assert batch.groups() == [list(batch[:3]), list(batch[3:])]
    state = await client.store.load("step-1.1.2")
    assert state.membership == Membership(batch_id="step-1", group_index=1, sample_index=2,
                                          group_size=3, group_policy=GroupPolicy.GROUP)  # fmt: skip
    assert state.request.prompt_token_ids == (3, 4, 5)
    assert state.request.group_id == "step-1.1"
    assert queued(client) == list(batch)
    info = await client.batch("step-1")
    assert (info.groups, info.group_size, info.ids) == (2, 3, list(batch))
    assert await client.batches() == ["step-1"]


async def test_a_retried_batch_returns_the_same_ids_and_a_different_one_is_refused(
    client: RolloutClient, real_redis: aredis.Redis
) -> None:
    prompts = [f.request(), f.request(prompt=(9,))]
    first = await client.submit(prompts, n=2, batch_id="b")
    again = await client.submit(prompts, n=2, batch_id="b")
    assert list(first) == list(again) and len(queued(client)) == 4
    before = await dump(real_redis)
    with pytest.raises(BatchConflict, match="'b'"):
        await client.submit(prompts, n=3, batch_id="b")
    with pytest.raises(BatchConflict):
        await client.submit([f.request(max_tokens=7)], batch_id="b")
    assert await dump(real_redis) == before


async def test_per_prompt_sampling_metadata_and_numpy_ids(client: RolloutClient) -> None:
    prompts = [
        RolloutRequest(prompt_token_ids=np.array([5, 6], np.int64),
                       sampling=SamplingParams(max_tokens=1), metadata={"task": "math", "k": 1}),
        RolloutRequest(prompt_token_ids=[np.int32(7)], sampling=SamplingParams(max_tokens=1)),
    ]  # fmt: skip
    sampling = [SamplingParams(max_tokens=3, temperature=0.0), SamplingParams(max_tokens=5)]
    batch = await client.submit(prompts, sampling=sampling)
    a, b = await client.store.load(batch[0]), await client.store.load(batch[1])
    assert (a.request.sampling.max_tokens, b.request.sampling.max_tokens) == (3, 5)
    assert a.request.prompt_token_ids == (5, 6) and a.request.metadata == {"task": "math", "k": 1}


class _Templater:
    """A chat template as a tokenizer applies it: fixed ids per role, then the content's."""

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> list[int]:
        assert kwargs == {"add_generation_prompt": True, "tokenize": True}
        ids = []
        for m in conversation:
            ids += [1 if m["role"] == "user" else 2, *[ord(c) % 50 for c in m["content"]]]
        return [*ids, 3]


async def test_chat_messages_are_templated_at_submit(redis_server: RedisServer) -> None:
    client = RolloutClient(redis_server.url, tokenizer=_Templater())  # type: ignore[arg-type]
    try:
        chat = ChatRequest(messages=[{"role": "user", "content": "hi"}], metadata={"id": 7})
        batch = await client.submit([chat], sampling=SamplingParams(max_tokens=4))
        state = await client.store.load(batch[0])
        assert state.request.prompt_token_ids == (1, ord("h") % 50, ord("i") % 50, 3)
        assert state.request.metadata == {"id": 7}
    finally:
        await client.aclose()
    no_tokenizer = RolloutClient(redis_server.url)
    try:
        with pytest.raises(InvalidRequest, match="tokenizer"):
            await no_tokenizer.submit([chat], sampling=SamplingParams(max_tokens=4))
    finally:
        await no_tokenizer.aclose()


async def test_ten_thousand_rollouts_take_a_bounded_number_of_round_trips(
    client: RolloutClient, real_redis: aredis.Redis
) -> None:
    await real_redis.config_resetstat()
    batch = await client.submit([f.request()] * 2500, n=4)
    assert len(batch) == 10_000
    info = await real_redis.info("commandstats")
    # One script per chunk of rollouts and one to record the batch; a new batch whose ids it
    # generates needs no lookups (commandstats also counts what scripts run: one HGET).
    assert info["cmdstat_evalsha"]["calls"] == 10_000 // defaults.SUBMIT_CHUNK + 1
    assert info["cmdstat_hget"]["calls"] <= 2
    assert len(queued(client)) == 10_000


async def test_long_prompts_go_in_chunks_no_script_holds_redis_50_ms(
    redis_server: RedisServer, client: RolloutClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 28 (every bulk operation in chunks): a script of 1,000 records of an
    8,192-token prompt (25 KB each) cost Redis ~0.24 s; chunks are bounded by bytes too."""
    prompt = f.request(prompt=tuple(range(1000, 1000 + 8192)))
    cpu = RedisCpu(redis_server.url, monkeypatch)
    try:
        batch = await client.submit([prompt] * 250, n=4, batch_id="long")
    finally:
        cpu.close()
    chunks = [cost for what, cost in cpu.calls if what == "submit_chunk"]
    assert max(chunks) < MAX_CALL_S, cpu.worst(3)
    assert len(chunks) > 1_000 * 25_000 // defaults.SUBMIT_CHUNK_BYTES  # chunked by bytes
    assert len(queued(client)) == len(batch) == 1_000
    assert (await client.result(batch[-1])).prompt_token_ids == prompt.prompt_token_ids


async def test_a_failure_between_chunks_strands_nothing_and_a_retry_completes(
    client: RolloutClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The second chunk fails while it is built, with the first one on the wire.
    real = batches._chunk_call
    calls = {"n": 0}

    def flaky(*args: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:
            raise ConnectionError("Redis went away between chunks")
        return real(*args)

    monkeypatch.setattr(batches, "_chunk_call", flaky)
    prompts = [f.request()] * 5
    with pytest.raises(ConnectionError):
        await client.submit(prompts, n=600, batch_id="big")  # 3,000 rollouts: 15 chunks
    recorded = [rid for rid in (await client.batch("big")).ids if await client.store.exists(rid)]
    # Every recorded rollout has its job, and nothing else has one.
    assert len(recorded) == defaults.SUBMIT_CHUNK and sorted(queued(client)) == sorted(recorded)
    monkeypatch.setattr(batches, "_chunk_call", real)
    batch = await client.submit(prompts, n=600, batch_id="big")
    assert sorted(queued(client)) == sorted(batch) and len(batch) == 3000


@pytest.mark.parametrize("named", [False, True], ids=["batch-ids", "named-ids"])
async def test_two_clients_submitting_the_same_batch_at_once_get_the_same_ids(
    redis_server: RedisServer, real_redis: aredis.Redis, named: bool
) -> None:
    """Issue 28: both got RolloutExists (each record carries its own ``at``, so the chunk
    script answered conflict, not duplicate). Two clients, two connections, their records
    written by two threads at once on a real redis-server; three chunks each, so the two
    interleave chunk by chunk. One records each rollout, the other returns the same ids;
    every rollout has exactly one job."""
    prompts = [f.request()] * 6
    a, b = RolloutClient(redis_server.url), RolloutClient(redis_server.url)
    try:
        for round_ in range(3):
            batch_id = f"same-{round_}"
            ids = [f"r{round_}.{i}" for i in range(2400)] if named else None
            got = await asyncio.gather(
                *(c.submit(prompts, n=400, batch_id=batch_id, ids=ids) for c in (a, b)),
                return_exceptions=True,
            )
            assert not [g for g in got if isinstance(g, BaseException)], got
            first, second = got
            assert list(first) == list(second) and len(first) == 2400  # type: ignore[arg-type]
            assert first.batch_id == second.batch_id == batch_id  # type: ignore[union-attr]
        expected = sorted([rid for r in range(3) for rid in (await a.batch(f"same-{r}")).ids])
        assert sorted(queued(a)) == expected  # one job per rollout: none twice, none missing
        assert set(await a.statuses(expected)) == {"pending"}
        assert (await a.stats()).by_state[Status.PENDING] == len(expected)
    finally:
        await a.aclose()
        await b.aclose()


def _with_metadata(metadata: dict[str, Any]) -> RolloutRequest:
    return RolloutRequest(
        prompt_token_ids=(1,), sampling=SamplingParams(max_tokens=1), metadata=metadata
    )


BAD: list[tuple[str, Any, str]] = [
    ("empty prompt", lambda: [f.request(prompt=())], "prompt_token_ids"),
    ("negative id", lambda: [f.request(prompt=(1, -1))], "prompt_token_ids"),
    ("float id", lambda: [f.request(prompt=(1, 2.0))], "prompt_token_ids"),
    ("max_tokens 0", lambda: [f.request(max_tokens=0)], "max_tokens"),
    ("max_tokens over cap", lambda: [f.request(max_tokens=2**21)], "max_tokens"),
    ("temperature inf", lambda: [f.request(temperature=float("inf"))], "temperature"),
    ("temperature nan", lambda: [f.request(temperature=float("nan"))], "temperature"),
    ("top_p 2", lambda: [f.request(top_p=2.0)], "top_p"),
    ("seed 2**64", lambda: [f.request(seed=2**64)], "seed"),
    ("stop None", lambda: [f.request(stop=None)], "stop"),
    ("stop_token_ids 5", lambda: [f.request(stop_token_ids=5)], "stop_token_ids"),
    ("logprobs over 20", lambda: [f.request(logprobs=21)], "logprobs must be <= 20"),
    ("big metadata", lambda: [_with_metadata({"x": "y" * 5000})], "metadata"),
    ("no prompts", lambda: [], "prompts"),
    ("not a request", lambda: [{"prompt_token_ids": [1]}], "prompts[0]"),
]


@pytest.mark.parametrize(("name", "make", "field"), BAD, ids=[b[0] for b in BAD])
async def test_bad_input_is_refused_naming_the_field_and_writes_nothing(
    client: RolloutClient, real_redis: aredis.Redis, name: str, make: Any, field: str
) -> None:
    await client.submit([f.request()], batch_id="existing")  # something to leave untouched
    before = await dump(real_redis)
    with pytest.raises(InvalidRequest, match=field.replace("[", r"\[").replace("]", r"\]")):
        await client.submit(make())
    assert await dump(real_redis) == before


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"n": 0}, InvalidRequest, "n must"),
        ({"n": True}, InvalidRequest, "n must"),
        ({"batch_id": "a:b"}, InvalidRolloutId, "batch id"),
        ({"batch_id": "{tag}"}, InvalidRolloutId, "batch id"),
        ({"ids": ["a b"]}, InvalidRolloutId, "rollout id"),
        ({"ids": ["a", "b"]}, InvalidRequest, "ids must name 1"),
        ({"group_policy": "all"}, InvalidRequest, "group_policy"),
        ({"sampling": [SamplingParams(max_tokens=1)] * 2}, InvalidRequest, "sampling"),
    ],
)
async def test_bad_submit_arguments_are_refused_and_write_nothing(
    client: RolloutClient, real_redis: aredis.Redis, kwargs: dict[str, Any], error: type,
    match: str,
) -> None:  # fmt: skip
    before = await dump(real_redis)
    with pytest.raises(error, match=match):
        await client.submit([f.request()], **kwargs)
    assert await dump(real_redis) == before


async def test_submitted_rollouts_count_as_pending(client: RolloutClient) -> None:
    await client.submit([f.request()] * 3, n=2)
    stats = await client.stats()
    assert stats.by_state[Status.PENDING] == 6 and stats.queues == {"rollouts": 6}


async def test_jobs_written_at_submit_read_back_as_rq_enqueues_them(
    client: RolloutClient,
) -> None:
    from rq.job import Job

    from store.queue import JOB_FUNC, enqueue_rollouts

    batch = await client.submit([f.request()], ids=["fast"])
    q: Queue = client._queue
    enqueue_rollouts(q, ["slow"])  # rq's own enqueue, for comparison
    fast_id, slow_id = q.job_ids
    fast = Job.fetch(fast_id, connection=q.connection, serializer=q.serializer)
    slow = Job.fetch(slow_id, connection=q.connection, serializer=q.serializer)
    assert await client.redis.hget(client.keys.snapshot(batch[0]), "job") == fast_id.encode()
    for job, rid in ((fast, "fast"), (slow, "slow")):
        assert (job.func_name, job.args, job.kwargs) == (JOB_FUNC, [], {"rollout_id": rid})
        assert job.description == f"rollout {rid}"
    # Everything Job.restore reads: the fields rq writes empty and submit leaves out read the
    # same as rq's own (started_at ... group_id, the callbacks).
    same = ("origin", "timeout", "result_ttl", "failure_ttl", "ttl", "meta", "retries_left",
            "started_at", "ended_at", "last_heartbeat", "worker_name", "group_id",
            "_success_callback_name", "_failure_callback_name", "_stopped_callback_name",
            "_dependency_ids", "allow_dependency_failures", "number_of_retries",
            "retry_intervals", "enqueue_at_front_on_retry", "repeats_left")  # fmt: skip
    assert {a: getattr(fast, a) for a in same} == {a: getattr(slow, a) for a in same}
    assert fast.get_status() == slow.get_status() == "queued"
    assert fast.enqueued_at is not None and fast.created_at is not None


@pytest.mark.slow
async def test_redis_killed_mid_submit_loses_nothing_and_enqueues_nothing_twice(
    tmp_path: Any,
) -> None:
    # A real SIGKILL of redis-server (AOF always) while a 20,000-rollout submit goes in, and a
    # restart a second later: the client's retries carry the submit through; a chunk whose
    # script ran before the kill is found recorded (identical records: no second job), one
    # that did not run is written. Every rollout ends up recorded with exactly one job.
    import threading
    import time

    from redis import Redis

    with RedisServer(tmp_path / "redis") as server:

        def outage() -> None:
            time.sleep(0.5)
            server.stop(kill=True)
            time.sleep(1.0)
            server.start()

        client = RolloutClient(server.url)
        thread = threading.Thread(target=outage)
        thread.start()
        started = time.monotonic()
        try:
            batch = await client.submit([f.request()] * 5000, n=4, batch_id="killed")
        finally:
            thread.join()
            await client.aclose()
        assert time.monotonic() - started > 1.5, "the outage should land mid-submit"
        sync = Redis.from_url(server.url)
        jobs = Queue("rollouts", connection=sync).job_ids
        assert len(jobs) == len(set(jobs)) == len(batch) == 20_000
        by_rollout = {}
        for job_id in jobs:
            description = sync.hget(f"rq:job:{job_id}", "description")
            by_rollout[description.decode().removeprefix("rollout ")] = job_id
        assert sorted(by_rollout) == sorted(batch)
        for rid in batch[::997]:
            assert sync.hget(f"dr:{{{rid}}}:snap", "job") == by_rollout[rid].encode()


async def test_a_prompt_is_stored_once_and_older_snapshots_with_a_copy_still_read(
    client: RolloutClient,
) -> None:
    batch = await client.submit([f.request(prompt=tuple(range(1, 200)))], n=2, batch_id="once")
    snap = client.keys.snapshot(batch[0])
    # The Submitted record lives in the log's first entry only.
    assert b"sub" not in await client.redis.hkeys(snap)  # type: ignore[misc]
    head = await client.store.head(batch[0])
    assert head.request.prompt_token_ids == tuple(range(1, 200))
    # Written by an older version: the same record copied into the snapshot too.
    first = await client.redis.xrange(client.keys.log(batch[1]), "0-1", "0-1")
    await client.redis.hset(client.keys.snapshot(batch[1]), "sub", first[0][1][b"e"])  # type: ignore[misc]
    old, new = await client.store.load_many([batch[1], batch[0]])
    assert not isinstance(old, Exception) and not isinstance(new, Exception)
    assert old.request == new.request and old.membership.sample_index == 1
    assert (await client.ack(batch_id="once")).live == list(batch)  # pending: kept


async def test_rollouts_are_admitted_at_the_newest_published_version(
    client: RolloutClient,
) -> None:
    """The batch's creation reads the newest version (no round trip of its own): a submit
    after a publish is admitted at it, generated ids and named ones alike, and a retry that
    writes the rollouts missing from its batch stamps the version of its own time."""
    request = RolloutRequest(prompt_token_ids=(1, 2), sampling=SamplingParams(max_tokens=4))
    before = await client.submit([request], batch_id="v0")
    await client.publish_weights(3, "/ckpt/3")
    generated = await client.submit([request], n=2, batch_id="v3")
    named = await client.submit([request], ids=["named-a"])
    states = [await client.store.load(r) for r in [*before, *generated, *named]]
    assert [s.admitted_version for s in states] == [0, 3, 3, 3]
    # A batch recorded whose rollouts were not (a crash between the two): the retry writes them.
    await client.publish_weights(4, "/ckpt/4")
    await client.redis.delete(*client.keys.rollout("v3.0.1"))
    again = await client.submit([request], n=2, batch_id="v3")
    assert list(again) == list(generated) and not again.fresh and generated.fresh
    reloaded = [await client.store.load(r) for r in again]
    assert [s.admitted_version for s in reloaded] == [3, 4]


async def test_two_clients_submitting_the_same_call_at_once_on_the_event_loop(
    redis_server: RedisServer, real_redis: aredis.Redis
) -> None:
    """A submit of one chunk (a harness's call) goes on the client's own connection, without
    a thread: one of two identical submits creates the batch, the other finds it recorded,
    looks its rollouts up and writes those missing; both return the same ids, and every
    rollout has exactly one job, whichever wrote it."""
    a, b = RolloutClient(redis_server.url), RolloutClient(redis_server.url)
    try:
        batches_ = []
        for round_ in range(20):
            got = await asyncio.gather(
                *(c.submit([f.request()], n=2, batch_id=f"call-{round_}") for c in (a, b))
            )
            assert list(got[0]) == list(got[1]) and [g.fresh for g in got].count(True) == 1
            batches_.append(got[0])
        expected = sorted(rid for batch in batches_ for rid in batch)
        assert sorted(queued(a)) == expected
        assert set(await a.statuses(expected)) == {"pending"}
    finally:
        await a.aclose()
        await b.aclose()
