"""Talking to a set of HTTP servers: sessions per event loop, retries, health, routing.

Generic over what is sent (the vLLM engine in `http.py` builds on it):
- one aiohttp ClientSession per event loop (a session is bound to the loop that made it);
- at most `max_in_flight` requests per server, and each request goes to the least-loaded
  healthy server;
- retries with exponential backoff and jitter on connection errors, timeouts, 5xx and 429
  only: any other 4xx is the caller's mistake and is raised at once (`HttpStatusError`);
- a server that fails at the connection level or with a 5xx is marked unhealthy and a
  background task probes its `/health` until it answers (running `on_recover` first, e.g.
  to give it the current weights) without stalling requests to the other servers;
- `aclose()` never raises out of cleanup.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from workers.engines.errors import EngineError, EngineUnavailable

log = logging.getLogger("rollouts.http")


@dataclass(frozen=True, slots=True, kw_only=True)
class HttpOptions:
    max_in_flight: int = 64  # per server; vLLM batches them, beyond that they only queue there
    retries: int = 4  # further attempts after the first, per request
    backoff_s: float = 0.2  # first retry delay; doubles per retry, times U[0.5, 1.5)
    backoff_max_s: float = 5.0
    connect_timeout_s: float = 5.0
    # Between two reads of a stream: a decode step takes milliseconds, a prefill or a
    # queued request far longer; a server silent this long is treated as dead.
    read_timeout_s: float = 120.0
    control_timeout_s: float = 300.0  # pause / reload / resume: a reload can be slow
    probe_interval_s: float = 0.5
    # How long a request waits for any healthy server before failing.
    unavailable_timeout_s: float = 30.0


class HttpStatusError(EngineError):
    """A server answered with an error status; `retryable` for 5xx and 429."""

    def __init__(self, status: int, body: str, retry_after: float | None = None) -> None:
        super().__init__(f"HTTP {status}: {body[:300]}")
        self.status = status
        self.retry_after = retry_after

    @property
    def retryable(self) -> bool:
        return self.status >= 500 or self.status == 429


def is_retryable(exc: BaseException) -> bool:
    """Connection errors, timeouts, 5xx and 429: worth another try (elsewhere)."""
    if isinstance(exc, HttpStatusError):
        return exc.retryable
    return isinstance(
        exc, aiohttp.ClientConnectionError | aiohttp.ClientPayloadError | TimeoutError
    )


def marks_unhealthy(exc: BaseException) -> bool:
    """429 is back-pressure from a live server; everything else retryable means trouble."""
    return is_retryable(exc) and not (isinstance(exc, HttpStatusError) and exc.status == 429)


@dataclass(eq=False)
class Server:
    url: str
    healthy: bool = True
    in_flight: int = 0
    failures: int = 0  # consecutive; reset when healthy again
    state: dict[str, Any] = field(default_factory=dict)  # owner's per-server bookkeeping


@dataclass(eq=False)
class _LoopState:
    session: aiohttp.ClientSession
    changed: asyncio.Event  # set whenever a slot frees or a server recovers
    prober: asyncio.Task[None] | None = None


Recover = Callable[[Server, aiohttp.ClientSession], Awaitable[None]]


class ServerPool:
    def __init__(
        self,
        urls: list[str],
        options: HttpOptions | None = None,
        *,
        on_recover: Recover | None = None,
        rng: random.Random | None = None,
    ) -> None:
        if not urls:
            raise ValueError("at least one server URL is needed")
        self.options = options or HttpOptions()
        self.servers = [Server(url.rstrip("/")) for url in urls]
        self._on_recover = on_recover
        self._rng = rng or random.Random()
        self._loops: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopState] = (
            weakref.WeakKeyDictionary()
        )
        self._closed = False

    # ---- sessions ----------------------------------------------------------------------

    def _state(self) -> _LoopState:
        loop = asyncio.get_running_loop()
        state = self._loops.get(loop)
        if state is None:
            if self._closed:
                raise EngineUnavailable("the HTTP client is closed")
            timeout = aiohttp.ClientTimeout(
                total=None,
                connect=self.options.connect_timeout_s,
                sock_read=self.options.read_timeout_s,
            )
            session = aiohttp.ClientSession(timeout=timeout)
            state = _LoopState(session=session, changed=asyncio.Event())
            self._loops[loop] = state
        return state

    def session(self) -> aiohttp.ClientSession:
        """This event loop's session (created on first use)."""
        return self._state().session

    # ---- routing ---------------------------------------------------------------------

    async def acquire(self) -> Server:
        """A slot on the least-loaded healthy server; waits for one, up to a deadline."""
        state = self._state()
        self._ensure_prober(state)
        deadline = asyncio.get_running_loop().time() + self.options.unavailable_timeout_s
        while True:
            candidates = [
                s for s in self.servers if s.healthy and s.in_flight < self.options.max_in_flight
            ]
            if candidates:
                server = min(candidates, key=lambda s: s.in_flight)
                server.in_flight += 1
                return server
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0 and not any(s.healthy for s in self.servers):
                raise EngineUnavailable(
                    f"no healthy server among {[s.url for s in self.servers]} "
                    f"for {self.options.unavailable_timeout_s} s"
                )
            state.changed.clear()
            # Full servers free up as requests end; unhealthy ones come back via the prober.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(state.changed.wait(), timeout=max(0.05, min(left, 1.0)))

    def release(self, server: Server) -> None:
        server.in_flight -= 1
        self._notify()

    def mark_unhealthy(self, server: Server, exc: BaseException) -> None:
        server.failures += 1
        if server.healthy:
            log.warning("server %s marked unhealthy: %s", server.url, exc)
        server.healthy = False
        with contextlib.suppress(RuntimeError):  # no running loop: the next acquire starts it
            self._ensure_prober(self._state())

    def _notify(self) -> None:
        for state in list(self._loops.values()):
            state.changed.set()

    async def backoff(self, attempt: int, retry_after: float | None = None) -> None:
        """Sleep before retry `attempt` (1-based): exponential, capped, with jitter."""
        base = min(self.options.backoff_max_s, self.options.backoff_s * 2 ** (attempt - 1))
        delay = base * self._rng.uniform(0.5, 1.5)
        if retry_after is not None:
            delay = max(delay, min(retry_after, self.options.backoff_max_s))
        await asyncio.sleep(delay)

    # ---- health ----------------------------------------------------------------------

    def _ensure_prober(self, state: _LoopState) -> None:
        if state.prober is None or state.prober.done():
            state.prober = asyncio.get_running_loop().create_task(self._probe_loop(state))

    async def _probe_loop(self, state: _LoopState) -> None:
        while not self._closed:
            await asyncio.sleep(self.options.probe_interval_s)
            sick = [s for s in self.servers if not s.healthy]
            if sick:
                # Concurrently: a hung server must not delay the others' recovery.
                await asyncio.gather(*(self._probe(s, state.session) for s in sick))

    async def _probe(self, server: Server, session: aiohttp.ClientSession) -> None:
        try:
            timeout = aiohttp.ClientTimeout(total=self.options.connect_timeout_s)
            async with session.get(f"{server.url}/health", timeout=timeout) as resp:
                if resp.status != 200:
                    return
            if self._on_recover is not None:
                await self._on_recover(server, session)
        except Exception as exc:
            # Still down (or recovery failed): stay unhealthy, probe again later.
            log.debug("probe of %s failed: %s", server.url, exc)
            return
        server.healthy = True
        server.failures = 0
        log.info("server %s is healthy again", server.url)
        self._notify()

    async def check_all(self) -> None:
        """Probe every server now (e.g. at start): mark the unreachable ones unhealthy."""
        state = self._state()
        for server in self.servers:
            try:
                timeout = aiohttp.ClientTimeout(total=self.options.connect_timeout_s)
                async with state.session.get(f"{server.url}/health", timeout=timeout) as resp:
                    if resp.status != 200:
                        raise HttpStatusError(resp.status, await resp.text())
            except Exception as exc:
                # Unreachable or unwell: route around it until the prober brings it back.
                self.mark_unhealthy(server, exc)

    # ---- plain requests with retries ---------------------------------------------------

    async def post_json(
        self, server: Server, path: str, body: Any = None, *, params: dict[str, str] | None = None
    ) -> Any:
        """POST to one server (control calls: no failover), retrying retryable failures."""
        timeout = aiohttp.ClientTimeout(total=self.options.control_timeout_s)
        attempt = 0
        while True:
            try:
                async with self.session().post(
                    f"{server.url}{path}", json=body, params=params, timeout=timeout
                ) as resp:
                    await raise_for_status(resp)
                    text = await resp.text()
                    return _json_or_none(text)
            except Exception as exc:
                attempt += 1
                if not is_retryable(exc) or attempt > self.options.retries:
                    raise
                await self.backoff(attempt, getattr(exc, "retry_after", None))

    # ---- close -------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Stop probing and close every session; never raises."""
        self._closed = True
        current = None
        with contextlib.suppress(RuntimeError):
            current = asyncio.get_running_loop()
        for loop, state in list(self._loops.items()):
            try:
                if loop is current:
                    if state.prober is not None:
                        state.prober.cancel()
                        with contextlib.suppress(asyncio.CancelledError):
                            await state.prober
                    await state.session.close()
                elif not loop.is_closed():
                    # Another live loop owns it: close it there.
                    if state.prober is not None:
                        loop.call_soon_threadsafe(state.prober.cancel)
                    asyncio.run_coroutine_threadsafe(state.session.close(), loop)
                # A closed loop's session cannot be closed any more; dropping it is all.
            except Exception as exc:
                # Cleanup must not raise: log and carry on with the other sessions.
                log.warning("error while closing the HTTP session: %s", exc)
        self._loops.clear()


async def raise_for_status(resp: aiohttp.ClientResponse) -> None:
    if resp.status < 400:
        return
    retry_after = None
    header = resp.headers.get("Retry-After")
    if header is not None:
        with contextlib.suppress(ValueError):  # an HTTP date instead of seconds: ignore it
            retry_after = float(header)
    raise HttpStatusError(resp.status, await resp.text(), retry_after)


def _json_or_none(text: str) -> Any:
    import json  # noqa: PLC0415  (tiny, but only control calls need it)

    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError:
        # Endpoints that answer 200 with no JSON body.
        return None
