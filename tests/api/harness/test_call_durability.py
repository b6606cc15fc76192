"""A harness call is durable: ``POST /v1/completions`` through the real ``openai`` client (or a
raw connection where the test must drop it), a real ``rollouts api`` process, real worker
processes and a redis-server of each test's own (AOF, fsync always). A worker SIGKILLed or
SIGTERMed mid-call, a weight update, a Redis restart and the API itself killed and restarted
are invisible to the caller but for the weight versions; retries attach to the call's one
rollout; an overloaded API answers what the clients retry; a disconnected caller's rollout is
kept or cancelled as ``--on-disconnect`` says.

The workers run the synthetic engine (resume-exact, paced at 200 tokens/s, so a call lasts
long enough to be interrupted), the SIGKILL case also the CPU engine on the tiny model: the
answer is compared with the same engine's uninterrupted greedy run."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from openai import AsyncOpenAI

from statemachine import Aborted, AbortReason, Status
from store.client import RolloutClient
from store.redis_server import RedisServer
from tests.api.harness.durability import (
    PROMPT,
    ApiProcess,
    completion,
    give_up_after,
    session_rollouts,
    until_tokens,
)
from tests.engine_pool import EnginePool
from tests.workers.helpers import SYNTHETIC, direct_greedy, greedy, start_worker, stop, until

pytestmark = [pytest.mark.slow, pytest.mark.redis_server]  # processes start: seconds each
FAST = ("--lease-ttl", "2", "--heartbeat", "0.25")  # a lost worker's rollout resumes in ~2 s
UNPACED = {"token_delay_s": 0.0}  # the worker that finishes what another left
N = 240  # tokens of a call: ~1.2 s at the synthetic engine's pace


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with RedisServer(tmp_path / "redis") as s:
        yield s


@pytest.fixture
async def client(server: RedisServer) -> AsyncIterator[RolloutClient]:
    c = RolloutClient(server.url)
    yield c
    await c.aclose()


@pytest.fixture
async def api(server: RedisServer, tmp_path: Path) -> AsyncIterator[ApiProcess]:
    a = await ApiProcess(server.url, tmp_path).start()
    yield a
    a.stop()


def oai(api: ApiProcess, retries: int = 0) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=api.v1, api_key="unused", max_retries=retries, timeout=300)


async def call(
    c: AsyncOpenAI, max_tokens: int = N, *, session: str | None = None, key: str | None = None
) -> Any:
    headers = {"X-Session-ID": session} if session else {}
    if key is not None:
        headers["Idempotency-Key"] = key
    return await c.completions.create(model="tiny", prompt=PROMPT, max_tokens=max_tokens,
                                      temperature=0, extra_headers=headers,
                                      extra_body={"return_token_ids": True,
                                                  "ignore_eos": True})  # fmt: skip


async def reference(pool: EnginePool | None, model: Path | None, n: int = N) -> list[int]:
    [(ids, _)] = await direct_greedy(pool, model, [tuple(PROMPT)], greedy(n))
    return [int(t) for t in ids]


async def one_rollout(client: RolloutClient, session: str) -> str:
    """The session's one call's one rollout, and that nothing else was recorded."""
    [c] = await client.session(session)
    assert await client.batches() == [c.batch_id]
    [rid] = c.ids
    return rid


@pytest.fixture(params=["synthetic", "cpu"])
def model(request: pytest.FixtureRequest) -> Path | None:
    return request.getfixturevalue("tiny_dense_dir") if request.param == "cpu" else SYNTHETIC


async def test_worker_sigkilled_mid_call(
    cpu_pool: EnginePool, api: ApiProcess, client: RolloutClient, model: Path | None,
    tmp_path: Path,
) -> None:  # fmt: skip
    n = N if model is None else 96  # the CPU engine is slower: fewer tokens do
    a = start_worker(api.url, model, "a", tmp_path / "a.log", *FAST, concurrency=1)
    b = None
    try:
        task = asyncio.create_task(call(oai(api), n, session="s-kill"))
        [rid] = await session_rollouts(client, "s-kill")
        await until_tokens(client, rid, 16)
        a.kill()
        a.wait(10)
        b = start_worker(api.url, model, "b", tmp_path / "b.log", *FAST, concurrency=1,
                         synthetic=UNPACED)  # fmt: skip
        out = await asyncio.wait_for(task, 240)
    finally:
        stop(a, *(p for p in [b] if p))
    [choice] = out.choices
    assert choice.finish_reason == "length"
    assert choice.token_ids == await reference(cpu_pool, model, n)
    assert await one_rollout(client, "s-kill") == rid
    events = await client.store.events(rid)
    assert [e.reason for e in events if isinstance(e, Aborted)] == [AbortReason.WORKER_LOST]


async def test_worker_sigtermed_mid_call(
    api: ApiProcess, client: RolloutClient, tmp_path: Path
) -> None:
    a = start_worker(api.url, SYNTHETIC, "a", tmp_path / "a.log", *FAST, concurrency=1)
    b = start_worker(api.url, SYNTHETIC, "b", tmp_path / "b.log", *FAST, concurrency=1)
    try:
        task = asyncio.create_task(call(oai(api), session="s-term"))
        [rid] = await session_rollouts(client, "s-term")
        await until_tokens(client, rid, 16)
        doomed = a if (await client.store.load(rid)).worker_id == "a" else b
        doomed.terminate()
        assert doomed.wait(60) == 0
        out = await asyncio.wait_for(task, 240)
    finally:
        stop(a, b)
    assert out.choices[0].token_ids == await reference(None, SYNTHETIC)
    assert await one_rollout(client, "s-term") == rid


async def test_weight_update_mid_call(
    api: ApiProcess, client: RolloutClient, tmp_path: Path
) -> None:
    w = start_worker(api.url, SYNTHETIC, "w", tmp_path / "w.log", concurrency=1)
    try:
        task = asyncio.create_task(call(oai(api), session="s-weights"))
        [rid] = await session_rollouts(client, "s-weights")
        await until_tokens(client, rid, 16)
        await client.publish_weights(1, str(tmp_path))
        out = await asyncio.wait_for(task, 240)
    finally:
        stop(w)
    result = await client.result(rid)
    assert out.choices[0].token_ids == result.response_token_ids.tolist()
    # The synthetic engine's tokens do not depend on its weights: the same answer, yet the
    # per-token versions say where the update landed.
    assert out.choices[0].token_ids == await reference(None, SYNTHETIC)
    segments = result.version_segments
    assert [v for v, _, _ in segments] == [0, 1] and segments[0][2] >= 16, segments


async def test_redis_restart_mid_call(
    api: ApiProcess, server: RedisServer, client: RolloutClient, tmp_path: Path
) -> None:
    w = start_worker(api.url, SYNTHETIC, "w", tmp_path / "w.log", *FAST, concurrency=1)
    try:
        task = asyncio.create_task(call(oai(api), session="s-redis"))
        [rid] = await session_rollouts(client, "s-redis")
        await until_tokens(client, rid, 16)
        await asyncio.to_thread(server.restart, kill=True)  # SIGKILL; AOF, fsync always
        out = await asyncio.wait_for(task, 240)
    finally:
        stop(w)
    assert out.choices[0].token_ids == await reference(None, SYNTHETIC)
    assert await one_rollout(client, "s-redis") == rid


@pytest.mark.parametrize("by", ["session", "key"])
async def test_api_killed_mid_call_and_restarted(
    api: ApiProcess, client: RolloutClient, tmp_path: Path, by: str
) -> None:
    """The openai client's own retries (connection errors, backoff) find the restarted API,
    which attaches the retry to the call's rollout: generated once."""
    w = start_worker(api.url, SYNTHETIC, "w", tmp_path / "w.log", concurrency=1)
    named = {"session": "s-api"} if by == "session" else {"key": "k-api", "session": "s-api"}
    try:
        task = asyncio.create_task(call(oai(api, retries=6), 600, **named))
        [rid] = await session_rollouts(client, "s-api")
        await until_tokens(client, rid, 16)
        api.kill()
        assert not task.done()
        await api.start()
        out = await asyncio.wait_for(task, 240)
    finally:
        stop(w)
    assert out.choices[0].token_ids == await reference(None, SYNTHETIC, 600)
    assert await one_rollout(client, "s-api") == rid
    assert (await client.store.load(rid)).attempt == 1  # never generated again


async def test_retries_attach_and_a_reused_key_is_a_409(
    api: ApiProcess, client: RolloutClient, tmp_path: Path
) -> None:
    w = start_worker(api.url, SYNTHETIC, "w", tmp_path / "w.log", concurrency=2)
    c = oai(api)
    try:
        # The same key twice at once, then once more after the answer: one rollout.
        first, second = await asyncio.gather(call(c, key="k1", session="s-key"),
                                             call(c, key="k1", session="s-key"))  # fmt: skip
        third = await call(c, key="k1", session="s-key")
        # The same key with another body: refused, nothing recorded; not retried by openai.
        with pytest.raises(openai.ConflictError) as refused:
            await call(oai(api, retries=2), N + 1, key="k1", session="s-key")
        # No key: the session and the body's hash are the key.
        fourth, fifth = await call(c, session="s-body"), await call(c, session="s-body")
        other = await call(c, 32, session="s-body")  # another body: another call
    finally:
        stop(w)
    ids = [x.id.removeprefix("cmpl-") for x in (first, second, third)]
    assert len(set(ids)) == 1
    ref = await reference(None, SYNTHETIC)
    assert all(x.choices[0].token_ids == ref for x in (first, second, third, fourth, fifth))
    assert refused.value.status_code == 409
    [keyed] = await client.session("s-key")  # the refused call recorded nothing
    assert keyed.batch_id == ids[0] and keyed.statuses == ("done",)
    calls = await client.session("s-body")
    assert [f"cmpl-{x.batch_id}" for x in calls] == [fourth.id, other.id]  # in call order
    assert fifth.id == fourth.id
    assert len(await client.batches()) == 3


async def test_a_dropped_connection_retried_is_one_rollout(
    api: ApiProcess, client: RolloutClient, tmp_path: Path
) -> None:
    w = start_worker(api.url, SYNTHETIC, "w", tmp_path / "w.log", concurrency=1)
    body = completion(N, session_id="s-drop")
    try:
        await give_up_after(api, body, 0.5)
        [rid] = await session_rollouts(client, "s-drop")
        async with (
            aiohttp.ClientSession() as http,
            http.post(f"{api.v1}/completions", json=body) as r,
        ):
            assert r.status == 200, await r.text()
            out = await r.json()
    finally:
        stop(w)
    assert out["choices"][0]["token_ids"] == await reference(None, SYNTHETIC)
    assert await one_rollout(client, "s-drop") == rid
    assert (await client.store.load(rid)).attempt == 1


async def test_overload_answers_429_with_retry_after(
    server: RedisServer, client: RolloutClient, tmp_path: Path
) -> None:
    api = await ApiProcess(server.url, tmp_path, ("--max-waiting", "1")).start()
    w = start_worker(api.url, SYNTHETIC, "w", tmp_path / "w.log", concurrency=2)
    try:
        task = asyncio.create_task(call(oai(api), session="s-first"))
        await session_rollouts(client, "s-first")
        async with aiohttp.ClientSession() as http:
            body = completion(8, session_id="s-second")
            async with http.post(f"{api.v1}/completions", json=body) as r:
                assert r.status == 429
                assert int(r.headers["Retry-After"]) >= 1
                error = (await r.json())["error"]
        assert error["code"] == 429 and "max-waiting" in error["message"]
        assert await client.session("s-second") == []  # nothing recorded
        with pytest.raises(openai.RateLimitError):
            await call(oai(api), 8, session="s-third")
        await asyncio.wait_for(task, 120)
        # The first call answered: the next is served.
        assert (await call(oai(api), 8, session="s-second")).choices[0].token_ids
    finally:
        stop(w)
        api.stop()


@pytest.mark.parametrize("mode", ["keep", "cancel"])
async def test_a_disconnected_callers_rollout_is_kept_or_cancelled(
    server: RedisServer, client: RolloutClient, tmp_path: Path, mode: str
) -> None:
    api = await ApiProcess(server.url, tmp_path,
                           ("--on-disconnect", mode, "--max-waiting", "1")).start()  # fmt: skip
    w = start_worker(api.url, SYNTHETIC, "w", tmp_path / "w.log", concurrency=2)
    try:
        await give_up_after(api, completion(1000, session_id="s-gone"), 1.0)  # a 5 s call
        [rid] = await session_rollouts(client, "s-gone")
        if mode == "cancel":
            await until(lambda: _status_is(client, rid, Status.CANCELLED), timeout=30)
        else:
            # The API stops waiting for a caller that left: its one place (--max-waiting 1)
            # is free for the next call while the kept rollout still generates. It frees the
            # place when it sees the disconnect, which a loaded machine may delay past the
            # give-up: the next call retries its 429s meanwhile (the rollout takes ~5 s).
            other = await _call_once_placed(api, session="s-next")
            assert other.choices[0].token_ids
            assert (await client.store.load(rid)).status is not Status.DONE
            # The session's call is its episode's first turn (store/harness_turns.py): kept,
            # it runs to its end, and the episode then waits for the session's next call.
            await until(lambda: _status_is(client, rid, Status.AWAITING_TOOL), timeout=120)
            assert (await client.store.load(rid)).num_tokens == 1000
    finally:
        stop(w)
        api.stop()
    assert "unexpected error" not in api.log.read_text()


async def _call_once_placed(api: ApiProcess, session: str, within_s: float = 10.0) -> Any:
    """An 8-token call, retried on 429 (no place free yet) for at most ``within_s``."""
    deadline = asyncio.get_running_loop().time() + within_s
    while True:
        try:
            return await call(oai(api), 8, session=session)
        except openai.RateLimitError:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.1)


async def _status_is(client: RolloutClient, rid: str, status: Status) -> bool:
    return (await client.store.load(rid)).status is status
