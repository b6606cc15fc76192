"""The environment runner: claims the pending tool calls of its queues, runs the tools it
serves, and records each call's result or failure, up to ``concurrency`` calls at once.

Every report goes through ``store.environment.EnvironmentClient``, fenced by the claim: a
runner whose claim is no longer live (its lease lapsed and the sweep gave the call up, or the
episode was cancelled) is refused with nothing written, and its heartbeat tells it so while
the tool still runs, which cancels the tool's task (``upkeep.py``).

A call still running when the runner stops (past its grace) or dies is never reported as a
failure: whether its effect happened is unknown, so its lease is left to lapse and the sweep
decides by the tool's declared effect (``store.tool_sweep``), whichever runner runs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from redis.exceptions import RedisError

from statemachine.episode import DEFAULT_ENV_QUEUE
from statemachine.errors import InvalidEvent
from statemachine.status import ToolFailure
from store import defaults
from store.environment import EnvironmentClient, ToolCallClaim
from store.errors import ClaimLost, StoreError
from store.logs import log_event
from workers.env.tools import Call, Tool, ToolFatal, ToolOutput, is_async, output_of
from workers.env.upkeep import Running, heartbeat_loop, sweep_loop
from workers.shutdown import is_outage, stop_all

log = logging.getLogger("rollouts.env")

DEFAULT_GRACE_S = 10.0
# An error recorded with a failure is for a person reading the episode: its first lines say
# what went wrong; a long message (a tool's whole stderr) would only bloat the event.
MAX_ERROR_CHARS = 1000
# Redis unreachable while claiming: wait this long before the next look (the client has
# already retried for about 15 s by then, store/connection.py).
CLAIM_BACKOFF_S = 1.0
# An idle runner blocks on its queues' doorbells this long at a time, and so sees a stop
# within it.
IDLE_WAIT_S = 0.25
# Claims in flight at once (each a few round trips); more only race for the same oldest call.
CLAIMERS = 4


@dataclass(frozen=True, slots=True, kw_only=True)
class RunnerConfig:
    """``heartbeat_s`` (default a fifth of the lease: several beats per lease, so one slow
    round trip costs nothing) and ``sweep_s`` (default a third of the lease: a dead runner's
    call is given up within about 1.3 leases) are derived from ``lease_s`` unless given."""

    runner_id: str
    queues: tuple[str, ...] = (DEFAULT_ENV_QUEUE,)
    concurrency: int = 1
    lease_s: float = defaults.TOOL_LEASE_TTL_S
    heartbeat_s: float | None = None
    sweep_s: float | None = None
    grace_s: float = DEFAULT_GRACE_S

    def __post_init__(self) -> None:
        if not self.runner_id:
            raise ValueError("runner_id must be a non-empty string")
        if not self.queues:
            raise ValueError("a runner serves at least one queue")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be 1 or more, got {self.concurrency}")
        if not self.lease_s > 0 or self.grace_s < 0:
            raise ValueError(f"lease_s must be > 0 and grace_s >= 0, got {self.lease_s}, "
                             f"{self.grace_s}")  # fmt: skip

    @property
    def beat_s(self) -> float:
        return self.heartbeat_s if self.heartbeat_s is not None else self.lease_s / 5

    @property
    def sweep_every_s(self) -> float:
        return self.sweep_s if self.sweep_s is not None else self.lease_s / 3


@dataclass(slots=True)
class RunnerStats:
    results: int = 0
    env_errors: int = 0
    env_fatals: int = 0
    fenced: int = 0  # calls whose claim was no longer live: cancelled, or their report refused
    unreported: int = 0  # reports Redis did not take: the lease lapses, the sweep decides
    abandoned: int = 0  # still running when the grace ran out
    swept: int = 0  # lost calls (any runner's) this runner's sweep recorded
    by_tool: dict[str, int] = field(default_factory=dict)  # executions started, per tool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class EnvRunner:
    def __init__(
        self, env: EnvironmentClient, tools: Mapping[str, Tool], config: RunnerConfig
    ) -> None:
        self.env = env
        self.tools = dict(tools)
        self.config = config
        self.stats = RunnerStats()
        self._async = {name: is_async(tool) for name, tool in self.tools.items()}
        self._running: dict[asyncio.Task[None], Running] = {}
        self._stop = asyncio.Event()
        self._next_queue = 0
        self._claiming = 0  # claims in flight

    def request_stop(self) -> None:
        """Stop claiming; calls running finish (within the grace) and are reported."""
        if not self._stop.is_set():
            log_event(log, logging.INFO, "stopping",
                      f"runner {self.config.runner_id} stopping: {len(self._running)} call(s) "
                      "running", runner=self.config.runner_id)  # fmt: skip
        self._stop.set()

    async def run(self) -> RunnerStats:
        cfg = self.config
        log_event(
            log, logging.INFO, "env_runner_started",
            f"runner {cfg.runner_id} serving {sorted(self.tools)} on queue(s) {list(cfg.queues)}",
            runner=cfg.runner_id, concurrency=cfg.concurrency, lease_s=cfg.lease_s,
        )  # fmt: skip
        upkeep = [
            asyncio.create_task(
                heartbeat_loop(self.env, self._running, cfg.beat_s, cfg.lease_s), name="heartbeat"
            ),
            asyncio.create_task(sweep_loop(self.env, cfg.sweep_every_s, self._swept), name="sweep"),
        ]
        stopped = asyncio.create_task(self._stop.wait(), name="stop")
        try:
            await self._claim_loop(stopped)
            await self._drain()
        finally:
            await stop_all([*upkeep, stopped], 5.0)
        return self.stats

    def _swept(self, n: int) -> None:
        self.stats.swept += n

    # -- claiming -----------------------------------------------------------------------------
    async def _claim_loop(self, stopped: asyncio.Task[Any]) -> None:
        """``CLAIMERS`` claim loops (at most ``concurrency``) share the slots: a claim is a few
        round trips, and calls requested together (a group's episodes end their turns
        together) waited for each other's claims in one loop: 29 ms per call on average,
        against 9 ms median, on bench/bench_episodes.py."""
        n = min(self.config.concurrency, CLAIMERS)
        await asyncio.gather(*(self._claimer(stopped) for _ in range(n)))

    async def _claimer(self, stopped: asyncio.Task[Any]) -> None:
        rung: tuple[str, str] | None = None  # the ring this claimer took: tried first
        while not self._stop.is_set():
            # Claimers never outnumber the slots, so a full house has a call running to
            # wait for.
            if len(self._running) + self._claiming >= self.config.concurrency:
                await asyncio.wait([*self._running, stopped], return_when=asyncio.FIRST_COMPLETED)
                continue
            try:
                claim = await self._claim_counted(rung)
            except (RedisError, OSError, StoreError) as exc:
                # Redis gone or refusing for longer than the client's retries: look again
                # later; calls wait on their queue meanwhile.
                log.warning("claiming failed: %s", exc, exc_info=not is_outage(exc))
                rung = None
                await self._pause(CLAIM_BACKOFF_S)
                continue
            rung = None
            if claim is None:
                rung = await self._idle()
                continue
            # Even if a stop came meanwhile: the call is ours now and runs within the grace.
            running = Running(claim)
            task = asyncio.create_task(self._serve(running), name=f"call {claim.rollout_id}")
            self._running[task] = running
            task.add_done_callback(self._running.pop)

    async def _claim_counted(self, rung: tuple[str, str] | None) -> ToolCallClaim | None:
        self._claiming += 1
        try:
            return await self._claim_next(rung)
        finally:
            self._claiming -= 1

    async def _claim_next(self, rung: tuple[str, str] | None) -> ToolCallClaim | None:
        """The call a ring named, if it is claimable; else the next claimable call of the
        queues, taken in turn so none starves the others."""
        cfg = self.config
        if rung is not None:
            queue, rid = rung
            claim = await self.env.claim(queue, cfg.runner_id, cfg.lease_s, first=rid)
            if claim is not None:
                return claim
        for i in range(len(cfg.queues)):
            at = (self._next_queue + i) % len(cfg.queues)
            if rung is not None and cfg.queues[at] == rung[0]:
                continue  # looked at just now
            claim = await self.env.claim(cfg.queues[at], cfg.runner_id, cfg.lease_s)
            if claim is not None:
                self._next_queue = (at + 1) % len(cfg.queues)
                return claim
        return None

    async def _idle(self) -> tuple[str, str] | None:
        """Until a call may be claimable on one of the queues (their doorbells ring at once), or
        ``IDLE_WAIT_S``: the loop then sees a stop within that (the blocking pop is never
        cancelled, which could leave its connection mid-reply). The ring taken, if any."""
        try:
            return await self.env.wait(self.config.queues, IDLE_WAIT_S)
        except (RedisError, OSError) as exc:
            # Redis gone: the next claim says so and backs off.
            log.debug("waiting for calls failed: %s", exc)
            await self._pause(IDLE_WAIT_S)
            return None

    async def _pause(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), seconds)

    async def _drain(self) -> None:
        if not self._running:
            return
        grace = self.config.grace_s
        log.info("waiting up to %.1f s for %d running call(s)", grace, len(self._running))
        _, pending = await asyncio.wait(list(self._running), timeout=grace)
        for task in pending:
            claim = self._running[task].claim
            self.stats.abandoned += 1
            log_event(
                log, logging.WARNING, "call_abandoned",
                f"call {claim.call_id} ({claim.name}) of {claim.rollout_id} still running after "
                f"{grace:.1f} s: left to its lease; the sweep decides by its declared effect",
                rollout_id=claim.rollout_id, call_id=claim.call_id, claim=claim.claim,
            )  # fmt: skip
        if pending:
            # An async tool stops here; a sync one's thread is a daemon: it dies with the
            # process.
            await stop_all(list(pending), 1.0)

    # -- one call -----------------------------------------------------------------------------
    async def _serve(self, running: Running) -> None:
        claim = running.claim
        try:
            await self._run_and_report(running)
        except asyncio.CancelledError:
            if not running.fenced:
                raise  # the grace ran out: left to the lease, as a dead runner's would be
            self.stats.fenced += 1
            log_event(
                log, logging.WARNING, "call_fenced",
                f"call {claim.call_id} of {claim.rollout_id} claim {claim.claim}: the claim is "
                "no longer live (lease lapsed or episode ended); tool cancelled",
                rollout_id=claim.rollout_id, call_id=claim.call_id, claim=claim.claim,
            )  # fmt: skip
        except Exception:
            # A bug of the runner's own (every foreseen failure is handled below): logged, and
            # the call left to its lease; the runner goes on serving the others.
            log.exception("serving call %s of %s failed", claim.call_id, claim.rollout_id)

    async def _run_and_report(self, running: Running) -> None:
        claim, name = running.claim, running.claim.name
        self.stats.by_tool[name] = self.stats.by_tool.get(name, 0) + 1
        restore = f", to restore {claim.env_revision or 'the start'} first" if claim.restore else ""
        log_event(
            log, logging.INFO, "tool_claimed",
            f"call {claim.call_id} ({name}) of {claim.rollout_id} claimed{restore}",
            rollout_id=claim.rollout_id, call_id=claim.call_id, claim=claim.claim,
        )  # fmt: skip
        started = time.monotonic()
        try:
            output = await self._run(claim)
        except ToolFatal as exc:
            seconds = time.monotonic() - started
            await self._fail(running, ToolFailure.ENV_FATAL, str(exc), seconds)
            return
        except Exception as exc:
            seconds = time.monotonic() - started
            log.warning("tool %s raised on %s", name, claim.rollout_id, exc_info=True)
            await self._fail(
                running, ToolFailure.ENV_ERROR, f"{type(exc).__name__}: {exc}", seconds
            )
            return
        seconds = time.monotonic() - started
        running.reporting = True
        try:
            await self.env.record_result(
                claim, output.observation_token_ids, env_handle=output.env_handle,
                env_revision=output.env_revision, seconds=seconds,
            )  # fmt: skip
        except InvalidEvent as exc:
            # Ids out of range, not integers, a revision not a string: checked before anything
            # is written; a bug of the tool that a rerun would repeat.
            why = f"tool {name!r} returned an invalid result: {exc}"
            await self._fail(running, ToolFailure.ENV_FATAL, why, seconds)
            return
        except ClaimLost as exc:
            self._refused(claim, exc)
            return
        except (RedisError, OSError, StoreError) as exc:
            self._unreported(claim, exc)
            return
        self.stats.results += 1
        log_event(
            log, logging.INFO, "tool_result",
            f"call {claim.call_id} ({name}) of {claim.rollout_id}: result recorded",
            rollout_id=claim.rollout_id, call_id=claim.call_id, claim=claim.claim,
            seconds=round(seconds, 3), observation_tokens=len(output.observation_token_ids),
        )  # fmt: skip

    async def _run(self, claim: ToolCallClaim) -> ToolOutput:
        tool = self.tools.get(claim.name)
        if tool is None:
            served = sorted(self.tools)
            raise ToolFatal(f"tool {claim.name!r} is not served by runner "
                            f"{self.config.runner_id} (it serves {served})")  # fmt: skip
        call = Call(claim)
        if self._async[claim.name]:
            returned = await tool(call)
        else:
            returned = await _in_daemon_thread(tool, call)
        return output_of(claim.name, returned)

    async def _fail(
        self, running: Running, failure: ToolFailure, error: str, seconds: float
    ) -> None:
        claim = running.claim
        running.reporting = True
        try:
            after = await self.env.record_failure(claim, failure, error[:MAX_ERROR_CHARS], seconds)
        except ClaimLost as exc:
            self._refused(claim, exc)
            return
        except (RedisError, OSError, StoreError) as exc:
            self._unreported(claim, exc)
            return
        if failure is ToolFailure.ENV_FATAL:
            self.stats.env_fatals += 1
        else:
            self.stats.env_errors += 1
        log_event(
            log, logging.WARNING, "tool_failed",
            f"call {claim.call_id} ({claim.name}) of {claim.rollout_id}: {failure.value}: "
            f"{error}; episode {after.status.value}",
            rollout_id=claim.rollout_id, call_id=claim.call_id, claim=claim.claim,
            failure=failure.value,
        )  # fmt: skip

    def _refused(self, claim: ToolCallClaim, exc: ClaimLost) -> None:
        self.stats.fenced += 1
        log_event(
            log, logging.WARNING, "call_fenced", f"report refused: {exc}",
            rollout_id=claim.rollout_id, call_id=claim.call_id, claim=claim.claim,
        )  # fmt: skip

    def _unreported(self, claim: ToolCallClaim, exc: Exception) -> None:
        self.stats.unreported += 1
        log_event(
            log, logging.ERROR, "call_unreported",
            f"call {claim.call_id} of {claim.rollout_id}: its report was not recorded ({exc}); "
            "its lease will lapse and the sweep decides by the tool's declared effect",
            rollout_id=claim.rollout_id, call_id=claim.call_id, claim=claim.claim,
        )  # fmt: skip


async def _in_daemon_thread(tool: Tool, call: Call) -> Any:
    """``tool(call)`` in a daemon thread of its own: unlike the loop's executor, whose threads
    the interpreter joins at exit, a tool that never returns cannot keep a stopping runner
    from exiting once its grace is over (no thread can be killed; this one dies with it)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Any] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if done.done():
            return  # cancelled meanwhile (fenced, or past the grace): the outcome is dropped
        if ok:
            done.set_result(value)
        else:
            done.set_exception(value)

    def target() -> None:
        try:
            value, ok = tool(call), True
        except BaseException as exc:  # handed to the awaiting task as it is
            value, ok = exc, False
        with contextlib.suppress(RuntimeError):
            # The loop is closed: the runner is gone, and the outcome with it.
            loop.call_soon_threadsafe(settle, ok, value)

    threading.Thread(target=target, name=f"tool {call.name}", daemon=True).start()
    return await done
