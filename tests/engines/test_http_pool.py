"""The HTTP client's retry, health and routing rules against small aiohttp servers of our own
on 127.0.0.1 that fail on command (no vLLM needed). The real-server path is in
test_vllm_http.py."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
import numpy as np
import pytest
from aiohttp import web

from statemachine.request import SamplingParams
from statemachine.status import FinishReason
from tests.engines.stream import collect_request
from workers.engines.base import EngineRequest
from workers.engines.errors import EngineUnavailable, RequestAborted, RequestRejected
from workers.engines.vllm import http_pool
from workers.engines.vllm.http import VllmHttpEngine
from workers.engines.vllm.http_pool import HttpOptions, HttpStatusError, ServerPool

FAST = HttpOptions(
    retries=3,
    backoff_s=0.01,
    backoff_max_s=0.05,
    probe_interval_s=0.05,
    unavailable_timeout_s=1.0,
    read_timeout_s=5.0,
)


@dataclass
class FakeVllm:
    """A stand-in for the generate endpoint: token i of a request is (sum(prompt) + i) % 1000
    (so a continuation from prompt + partial yields exactly the uninterrupted tokens)."""

    fail_next: list[int] = field(default_factory=list)  # statuses to answer, in order
    die_after: int | None = None  # cut the stream after this many tokens, once
    delay_s: float = 0.0
    healthy: bool = True
    generate_calls: int = 0
    health_calls: int = 0
    control_calls: list[str] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    concurrent: int = 0
    peak: int = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/inference/v1/generate", self.generate)
        app.router.add_get("/health", self.health)
        app.router.add_post("/inference/v1/abort_requests", self.abort)
        for path in ("/pause", "/resume", "/reset_prefix_cache", "/collective_rpc"):
            app.router.add_post(path, self.control)
        return app

    async def health(self, request: web.Request) -> web.Response:
        self.health_calls += 1
        return web.Response(status=200 if self.healthy else 503)

    async def control(self, request: web.Request) -> web.Response:
        self.control_calls.append(request.path)
        if request.path == "/collective_rpc":
            body = await request.json()
            ok = "missing" not in body["args"][0]
            return web.json_response({"results": [None if ok else "FileNotFoundError: missing"]})
        return web.json_response({"ok": True})

    async def abort(self, request: web.Request) -> web.Response:
        self.aborted.extend((await request.json())["request_ids"])
        return web.json_response({})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        self.generate_calls += 1
        if self.fail_next:
            status = self.fail_next.pop(0)
            headers = {"Retry-After": "0"} if status == 429 else {}
            return web.json_response({"error": "nope"}, status=status, headers=headers)
        body = await request.json()
        base = sum(body["token_ids"])
        n = body["sampling_params"]["max_tokens"]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        self.concurrent += 1
        self.peak = max(self.peak, self.concurrent)
        try:
            for i in range(n):
                if self.die_after is not None and i == self.die_after:
                    self.die_after = None
                    assert request.transport is not None
                    request.transport.close()  # a crash mid-stream
                    return resp
                await asyncio.sleep(self.delay_s)
                token = (base + i) % 1000
                choice = {
                    "index": 0,
                    "token_ids": [token],
                    "logprobs": {"content": [{"token_id": token, "logprob": -0.5}]},
                    "finish_reason": "length" if i == n - 1 else None,
                }
                await resp.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
        finally:
            self.concurrent -= 1
        return resp


class Served:
    """A FakeVllm on 127.0.0.1 in its own thread and loop (so the client's loop is separate
    and the server can be stopped and restarted on the same port)."""

    def __init__(self, fake: FakeVllm) -> None:
        self.fake = fake
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._runner: web.AppRunner | None = None

    def _call(self, coro):  # type: ignore[no-untyped-def]
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    def start(self) -> Served:
        async def go() -> None:
            self._runner = web.AppRunner(self.fake.app())
            await self._runner.setup()
            await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

        self._call(go())
        return self

    def stop(self) -> None:
        if self._runner is not None:
            self._call(self._runner.cleanup())
            self._runner = None

    def close(self) -> None:
        self.stop()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


@pytest.fixture
def served() -> AsyncIterator[list[Served]]:
    made: list[Served] = []

    def make(fake: FakeVllm | None = None) -> Served:
        s = Served(fake or FakeVllm()).start()
        made.append(s)
        return s

    yield make  # type: ignore[misc]
    for s in made:
        s.close()


def request(rid: str = "r", n: int = 20, prompt: tuple[int, ...] = (1, 2, 3)) -> EngineRequest:
    return EngineRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling=SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
    )


def expected(prompt: tuple[int, ...], n: int) -> list[int]:
    return [(sum(prompt) + i) % 1000 for i in range(n)]


async def test_generates_and_frozen_result(served) -> None:
    s = served()
    engine = VllmHttpEngine([s.url], options=FAST)
    try:
        result = await engine.generate_once(request(n=5))
        assert result.token_ids.tolist() == expected((1, 2, 3), 5)
        assert result.finish_reason == "length"
        assert result.logprobs.dtype == np.float32
        with pytest.raises(AttributeError):
            result.finish_reason = "stop"  # type: ignore[misc]
    finally:
        await engine.aclose()


@pytest.mark.parametrize("status", [500, 502, 503, 429])
async def test_retries_5xx_and_429(served, status: int) -> None:
    s = served(FakeVllm(fail_next=[status, status]))
    engine = VllmHttpEngine([s.url], options=FAST)
    try:
        out = await collect_request(engine, request(n=4))
        assert out.token_ids == expected((1, 2, 3), 4)
        assert s.fake.generate_calls == 3
    finally:
        await engine.aclose()


@pytest.mark.parametrize("status", [400, 404, 409, 422])
async def test_never_retries_other_4xx(served, status: int) -> None:
    s = served(FakeVllm(fail_next=[status]))
    engine = VllmHttpEngine([s.url], options=FAST)
    try:
        # 400 and 422 are vLLM refusing the request itself (a request error, never retried
        # on any server); other 4xx stay engine errors (a misconfigured URL, a conflict).
        rejected = status in (400, 422)
        with pytest.raises(RequestRejected if rejected else HttpStatusError) as info:
            await collect_request(engine, request())
        cause = info.value.__cause__ if rejected else info.value
        assert isinstance(cause, HttpStatusError) and cause.status == status
        assert s.fake.generate_calls == 1
        assert engine.pool.servers[0].healthy  # a 4xx says nothing about the server's health
    finally:
        await engine.aclose()


async def test_retries_run_out(served) -> None:
    s = served(FakeVllm(fail_next=[503] * 10))
    engine = VllmHttpEngine([s.url], options=FAST)
    try:
        with pytest.raises(EngineUnavailable):
            await collect_request(engine, request())
        assert s.fake.generate_calls == FAST.retries + 1
    finally:
        await engine.aclose()


async def test_backoff_grows_with_jitter_and_caps(monkeypatch: pytest.MonkeyPatch) -> None:
    # The delays asked of asyncio.sleep, not the wall time slept (which a loaded CI machine
    # stretches: a wall-time bound failed there).
    asked: list[float] = []

    async def sleep(delay: float) -> None:
        asked.append(delay)

    pool = ServerPool(
        ["http://127.0.0.1:9"],
        HttpOptions(backoff_s=0.01, backoff_max_s=0.04),
        rng=random.Random(1),
    )
    monkeypatch.setattr(http_pool.asyncio, "sleep", sleep)
    for attempt in (1, 2, 3, 4, 5):
        await pool.backoff(attempt)
    monkeypatch.undo()
    bases = [0.01, 0.02, 0.04, 0.04, 0.04]  # doubling, capped at backoff_max_s
    assert all(0.5 * b <= d <= 1.5 * b for d, b in zip(asked, bases, strict=True)), asked
    assert len(set(asked)) == len(asked)  # jittered
    await pool.aclose()


async def test_dead_server_mid_stream_resumes_on_another(served) -> None:
    """A cut stream: the tokens so far stand, the rest comes from the healthy server, and
    the whole equals the uninterrupted output; the dead one is marked unhealthy."""
    flaky = served(FakeVllm(die_after=7, delay_s=0.002))
    good = served(FakeVllm(delay_s=0.002))
    engine = VllmHttpEngine([flaky.url, good.url], options=FAST)
    flaky.fake.healthy = False  # stays unhealthy for the prober once cut
    try:
        # Least-loaded routing: occupy `good` so the request goes to `flaky` first.
        blocker = asyncio.create_task(collect_request(engine, request("blocker", n=60)))
        await asyncio.sleep(0.02)
        out = await collect_request(engine, request("r", n=20, prompt=(4, 5)))
        await blocker
        assert out.token_ids == expected((4, 5), 20)
        assert flaky.fake.generate_calls == 1
        assert not engine.pool.servers[0].healthy
    finally:
        await engine.aclose()


async def test_unhealthy_server_is_probed_back(served) -> None:
    """The only server answers 503 once: marked unhealthy, the retry waits until the prober
    sees /health answer 200, then the request completes there."""
    s = served(FakeVllm(fail_next=[503]))
    engine = VllmHttpEngine([s.url], options=FAST)
    try:
        out = await collect_request(engine, request(n=3))
        assert out.token_ids == expected((1, 2, 3), 3)
        assert s.fake.generate_calls == 2
        assert s.fake.health_calls >= 1  # it came back through a probe
        assert engine.pool.servers[0].healthy
        assert engine.pool.servers[0].failures == 0
    finally:
        await engine.aclose()


async def test_restarted_server_comes_back_without_stalling_others(served) -> None:
    a = served(FakeVllm(delay_s=0.001))
    b = served(FakeVllm(delay_s=0.001))
    engine = VllmHttpEngine([a.url, b.url], options=FAST)
    try:
        await engine.pool.check_all()
        a.stop()  # down: connection refused
        outs = await asyncio.gather(
            *(collect_request(engine, request(f"r{i}", n=5)) for i in range(6))
        )
        assert all(o.token_ids == expected((1, 2, 3), 5) for o in outs)  # b served them all
        assert not engine.pool.servers[0].healthy
        a.start()  # back on the same port
        for _ in range(200):
            if engine.pool.servers[0].healthy:
                break
            await asyncio.sleep(0.02)
        assert engine.pool.servers[0].healthy
    finally:
        await engine.aclose()


async def test_weights_synced_to_a_recovered_server(served) -> None:
    """A server that missed a load gets the current weights before it serves again."""
    a, b = served(), served()
    engine = VllmHttpEngine([a.url, b.url], options=FAST)
    try:
        await engine.pool.check_all()
        a.stop()
        await engine.pool.check_all()  # a is unhealthy now
        await engine.load_weights("/ckpt/v1", 1)
        assert "/collective_rpc" in b.fake.control_calls
        assert "/collective_rpc" not in a.fake.control_calls
        a.start()
        for _ in range(200):
            if engine.pool.servers[0].healthy:
                break
            await asyncio.sleep(0.02)
        assert engine.pool.servers[0].healthy
        assert a.fake.control_calls == [
            "/pause",
            "/collective_rpc",
            "/reset_prefix_cache",
            "/resume",
        ]
        assert engine.weight_version == 1
    finally:
        await engine.aclose()


async def test_failed_reload_restores_and_keeps_version(served) -> None:
    s = served()
    engine = VllmHttpEngine([s.url], options=FAST)
    try:
        await engine.load_weights("/ckpt/v1", 1)
        with pytest.raises(Exception, match="missing"):
            await engine.load_weights("/ckpt/missing", 2)
        assert engine.weight_version == 1
        rpc = [c for c in s.fake.control_calls if c == "/collective_rpc"]
        assert len(rpc) == 3  # v1, the failed one, the restore of v1
    finally:
        await engine.aclose()


async def test_least_loaded_and_bounded_in_flight(served) -> None:
    a = served(FakeVllm(delay_s=0.005))
    b = served(FakeVllm(delay_s=0.005))
    options = HttpOptions(max_in_flight=2, retries=0, unavailable_timeout_s=5.0)
    engine = VllmHttpEngine([a.url, b.url], options=options)
    try:
        outs = await asyncio.gather(
            *(collect_request(engine, request(f"r{i}", n=10)) for i in range(8))
        )
        assert all(o.finish_reason is FinishReason.LENGTH for o in outs)
        assert a.fake.peak <= 2 and b.fake.peak <= 2  # bounded per server
        assert a.fake.generate_calls == b.fake.generate_calls == 4  # spread evenly
    finally:
        await engine.aclose()


async def test_abort_stops_the_stream_and_tells_the_server(served) -> None:
    s = served(FakeVllm(delay_s=0.01))
    engine = VllmHttpEngine([s.url], options=FAST)
    try:
        stream = engine.generate(request("long", n=500))
        got = [await anext(stream) for _ in range(3)]
        assert len(got) == 3
        await engine.abort("long")
        with pytest.raises(RequestAborted):
            await anext(stream)
        await engine.abort("long")  # idempotent
        await engine.abort("never-existed")
        assert s.fake.aborted and s.fake.aborted[0].startswith("generate-tokens-long@")
    finally:
        await engine.aclose()


async def test_one_session_per_loop_and_aclose_never_raises(served) -> None:
    s = served()
    engine = VllmHttpEngine([s.url], options=FAST)
    first = engine.pool.session()
    assert engine.pool.session() is first  # same loop, same session

    def other_loop() -> tuple[object, object]:
        async def go() -> tuple[object, object]:
            out = await collect_request(engine, request("t", n=2))
            return engine.pool.session(), out

        return asyncio.run(go())  # this loop closes with its session still open

    other, out = await asyncio.to_thread(other_loop)
    assert other is not first
    assert out.token_ids == expected((1, 2, 3), 2)  # type: ignore[attr-defined]
    await engine.aclose()  # one session on a closed loop, one here: must not raise
    await engine.aclose()  # twice is fine
    assert first.closed


async def test_no_healthy_server_fails_fast(served) -> None:
    engine = VllmHttpEngine(["http://127.0.0.1:9"], options=FAST)  # nothing listens there
    try:
        with pytest.raises(EngineUnavailable):
            await collect_request(engine, request())
    finally:
        await engine.aclose()


async def test_connection_error_is_retryable_and_not_4xx() -> None:
    from workers.engines.vllm.http_pool import is_retryable, marks_unhealthy

    assert is_retryable(aiohttp.ServerDisconnectedError())
    assert is_retryable(TimeoutError())
    assert is_retryable(HttpStatusError(503, ""))
    assert is_retryable(HttpStatusError(429, ""))
    assert not marks_unhealthy(HttpStatusError(429, ""))
    assert not is_retryable(HttpStatusError(400, ""))
    assert not is_retryable(ValueError())
