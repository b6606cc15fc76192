"""One attempt of one rollout on an engine, recorded durably as it goes.

The runner opens an attempt (the domain's ``commands.begin``), streams the engine's chunks
into a buffer, and hands the buffer to the worker's group-commit ``Checkpointer`` whenever
its flush-point policy (``Checkpointer.flush_due``) says so. Generation never waits for
Redis: while one checkpoint is in flight the next tokens keep buffering. The last checkpoint
and ``Finished`` (or ``Aborted``) go together in one chain. Each round trip costs syscalls,
wake-ups and an fsync (AOF ``always``) on the cores the engine shares, which is why the
worker's rollouts share them.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

from statemachine import (
    LIVE,
    AbortReason,
    FailureClass,
    FinishReason,
    RolloutState,
    Status,
    commands,
)
from statemachine.arrays import clamp_logprobs
from statemachine.commands import NewTokens
from statemachine.errors import ModelMismatch
from store import AppendRefused, EventStore, defaults
from store.coalesce import Coalescer
from store.leases import Leases, now_ms
from store.logs import log_event
from workers.checkpoint import Cadence, Checkpointer
from workers.engines.base import Chunk, Engine, EngineRequest, Joined, StepEngine, join_chunks
from workers.engines.errors import EngineDead, EngineError, RequestAborted, RequestRejected
from workers.engines.inflight import check_request, context_full, fit_to_context
from workers.failures import record_failure, worker_lost_aborts
from workers.stepper import Stepper, Track

log = logging.getLogger("rollouts.runner")


def _wrong_model(recorded: str, ours: str) -> str:
    return f"earlier attempts ran model {recorded!r}; this worker runs {ours!r}"


class Outcome(StrEnum):
    FINISHED = "finished"  # done now (or was already terminal when the job ran)
    ENGINE_ERROR = "engine_error"  # progress kept, attempt aborted; the worker retries or fails it
    ABORTED = "aborted"  # stopped on request (shutdown, weight update); progress kept
    LOST = "lost"  # another writer took the rollout over (fenced out); nothing more to do
    DUPLICATE = "duplicate"  # a live worker holds the rollout's lease: this job is a duplicate
    ENGINE_DEAD = "engine_dead"  # progress kept, attempt aborted; the engine is gone for good
    WRONG_QUEUE = "wrong_queue"  # the job came from a queue the rollout was not submitted to
    WRONG_MODEL = "wrong_model"  # earlier attempts ran another model: not for this worker
    FAILED = "failed"  # recorded failed here: a request error, or its worker-lost budget is spent


# Outcomes after which the rollout's lease, if any, belongs to another attempt (or was never
# taken): dropping it would let the reaper abort a live attempt elsewhere.
_NOT_OURS = frozenset({Outcome.LOST, Outcome.DUPLICATE, Outcome.WRONG_QUEUE, Outcome.WRONG_MODEL})


@dataclass(frozen=True, slots=True)
class RunResult:
    outcome: Outcome
    state: RolloutState
    error: str | None = None  # the engine's error (ENGINE_ERROR), or why it was refused


@dataclass(slots=True)
class Stats:
    """Counters of one worker process, across all its rollouts: each counts what this process
    recorded in Redis, where it recorded it (``workers.metrics`` serves them as they are)."""

    tokens: int = 0
    checkpoints: int = 0
    nonfinite_logprobs: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    engine_dead: str | None = None  # why the engine died, if it did (the worker then stops)
    aborts: dict[str, int] = field(default_factory=dict)  # Aborted events appended, by reason
    resumes: int = 0  # attempts begun from saved tokens
    takeovers: int = 0  # live attempts of a worker whose lease lapsed, fenced out by this one
    ended: dict[str, int] = field(default_factory=dict)  # rollouts ended here, by status
    failures: dict[str, int] = field(default_factory=dict)  # of those failed, by class

    def aborted(self, reason: AbortReason) -> None:
        self.aborts[reason.value] = self.aborts.get(reason.value, 0) + 1

    def end(self, status: Status, failure: FailureClass | None = None) -> None:
        self.ended[status.value] = self.ended.get(status.value, 0) + 1
        if failure is not None:
            self.failures[failure.value] = self.failures.get(failure.value, 0) + 1


class EnginePlace(Protocol):
    """A rollout's place on the engine, as the worker hands them out (``RolloutRunner.run``)."""

    async def enter(self) -> None:
        """Until the engine has room for one more of the worker's requests."""

    def nearly_free(self) -> None:
        """The rollout has at most ``prefetch_tokens`` left: the worker may take its next job."""

    def free(self) -> None:
        """The rollout no longer needs the engine. Called at most once."""


@dataclass(slots=True)
class _Attempt:
    """What the runner knows of one rollout while it is inside ``run``."""

    place: EnginePlace | None  # see ``run``
    request_id: str | None = None  # the engine request, once there is one
    stop: tuple[AbortReason, str] | None = None  # why ``stop`` was asked, if it was
    freed: bool = False

    def nearly_free(self) -> None:
        if self.place is not None:
            self.place.nearly_free()

    def free_engine(self) -> None:
        if self.place is not None and not self.freed:
            self.freed = True
            self.place.free()


class RolloutRunner:
    def __init__(
        self,
        store: EventStore,
        checkpointer: Checkpointer,
        engine: Engine,
        worker_id: str,
        *,
        cadence: Cadence | None = None,
        stats: Stats | None = None,
        weight_mode: str = "abort",
        leases: Leases | None = None,
        lease_ttl_s: float = defaults.LEASE_TTL_S,
        model_id: str | None = None,
        max_worker_lost: int = defaults.MAX_WORKER_LOST,
        stepped: bool | None = None,
        prefetch_tokens: int = 0,
    ) -> None:
        """``prefetch_tokens``: when a rollout has that many tokens left, its place's
        ``nearly_free`` is called (0: never). ``stepped``: stream through the engine's steps
        (``workers.stepper``) rather than one ``generate`` stream per rollout; None: whenever
        the engine offers them (``offers_steps``), the default; False: the per-rollout streams
        (an engine without steps, such as vLLM over HTTP, always runs that way)."""
        self.store = store
        self.checkpointer = checkpointer
        self.engine = engine
        self.worker_id = worker_id
        self.stats = stats or Stats()
        self.weight_mode = weight_mode
        self.leases = leases
        self.lease_ttl_s = lease_ttl_s
        # A rollout's first load, its lease and the lease's drop: each is one round trip of
        # its own per rollout, and many rollouts start and end together (store.coalesce).
        self._load = Coalescer(store.load_many)
        if leases is not None:
            self._take = Coalescer(lambda ids: leases.take_many(ids, self.lease_ttl_s))
            self._drop = Coalescer(leases.drop_many)
        self.max_worker_lost = max_worker_lost
        self.prefetch_tokens = prefetch_tokens
        # What every attempt records as its model; the engine's own identity unless the
        # deployment names it (e.g. vLLM servers whose model directory is not mounted here).
        self.model_id = engine.model_id if model_id is None else model_id
        if cadence is not None:
            checkpointer.cadence = cadence
        self.stepper: Stepper | None = None
        if stepped if stepped is not None else offers_steps(engine):
            assert isinstance(engine, StepEngine), f"{type(engine).__name__} has no steps"
            self.stepper = Stepper(
                engine, checkpointer, self._new_tokens, self._saved, ahead=prefetch_tokens
            )
        self._attempts: dict[str, _Attempt] = {}  # rollouts inside run()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def cadence(self) -> Cadence:
        return self.checkpointer.cadence

    @property
    def active(self) -> list[str]:
        """The rollouts inside ``run`` (their leases are this worker's to renew)."""
        return list(self._attempts)

    async def wait_idle(self) -> None:
        """Until no rollout is inside ``run`` (every one finished, aborted or was lost)."""
        await self._idle.wait()

    async def stop(self, rollout_id: str, reason: AbortReason, detail: str = "") -> None:
        """Abort the rollout's engine request; ``run`` then saves progress and returns ABORTED.
        A rollout not inside ``run`` has nothing to stop."""
        attempt = self._attempts.get(rollout_id)
        if attempt is None:
            return
        attempt.stop = (reason, detail)
        if attempt.request_id is not None:
            await self._abort_request(attempt.request_id)

    async def _abort_request(self, request_id: str) -> None:
        if self.stepper is not None:
            await self.stepper.abort(request_id)
        else:
            await self.engine.abort(request_id)

    async def run(
        self,
        rollout_id: str,
        *,
        place: EnginePlace | None = None,
        queue: str | None = None,
    ) -> RunResult:
        """One attempt of the rollout. ``place``: the rollout's place on the engine; entered
        before its request goes to the engine, ``nearly_free`` once it has ``prefetch_tokens``
        left, and ``free`` when a finished rollout no longer needs the engine: its last events
        are stamped and handed to the group commit, and what is left (that round trip, the
        lease, rq's books) need not keep the next rollout off the engine. ``queue``: the queue
        its job came from; a job from any other queue than the rollout's own is refused
        (``WRONG_QUEUE``)."""
        attempt = self._attempts[rollout_id] = _Attempt(place)
        self._idle.clear()
        try:
            result = await self._run(rollout_id, queue, attempt)
            if self.leases is not None and (
                result.outcome not in _NOT_OURS or result.state.terminal
            ):
                # Our attempt is over: the lease goes before the job is handed back, so that the
                # next worker's lease is never the one we drop. An ended rollout (e.g. cancelled
                # under us: LOST) takes no lease ever again, so its lease is nobody's.
                await self._drop(rollout_id)
            return result
        finally:
            if self._attempts.get(rollout_id) is attempt:  # not a later run's record
                del self._attempts[rollout_id]
            if not self._attempts:
                self._idle.set()

    async def _run(self, rollout_id: str, queue: str | None, attempt: _Attempt) -> RunResult:
        state = await self._load(rollout_id)
        if state.terminal:
            return RunResult(Outcome.FINISHED, state)  # a duplicate or late job: nothing to do
        if queue is not None and queue != state.queue:
            return RunResult(
                Outcome.WRONG_QUEUE,
                state,
                f"job on queue {queue!r}, rollout submitted to {state.queue!r}",
            )
        if state.model and self.model_id and state.model != self.model_id:
            # Checked before the lease and the attempt: a refusal writes nothing. The domain
            # refuses the attempt too (ModelMismatch), should a stale view slip past this.
            return RunResult(Outcome.WRONG_MODEL, state, _wrong_model(state.model, self.model_id))
        if state.too_stale(self.engine.weight_version):
            return await self._cancel_stale(state)
        if self.leases is not None:
            if state.status in LIVE:
                expiry = await self.leases.expiry(rollout_id)
                if expiry is not None and expiry > now_ms():
                    # A live worker is generating it (rq delivered the job twice): leave it be.
                    return RunResult(Outcome.DUPLICATE, state)
            # Lease first, attempt second: a crash in between leaves a lease the reaper turns
            # into a re-enqueue, never a live attempt nobody watches.
            await self._take(rollout_id)
        try:
            if state.status in LIVE:
                spent = await self._worker_lost_budget_spent(state)
                if spent is not None:
                    return spent
            try:
                state = await self._begin(state)
            except ModelMismatch:
                # Another attempt began on a different model since we loaded it; the lease
                # is that attempt's now (its heartbeats renew it), so it is not ours to drop.
                state = await self.store.load(rollout_id)
                return RunResult(
                    Outcome.WRONG_MODEL, state, _wrong_model(state.model, self.model_id)
                )
            if state.remaining_tokens == 0 or context_full(state, self.engine.limits):
                # The budget was used up before an abort, or a capped rollout filled the
                # context: finish without asking the engine.
                done = await self._finish(attempt, state, None, FinishReason.LENGTH, None)
                return RunResult(Outcome.FINISHED, done)
            return await self._generate(state, attempt)
        except AppendRefused:
            # Fenced out: our attempt is no longer the live one. Someone else owns it now.
            return RunResult(Outcome.LOST, await self.store.load(rollout_id))

    async def _worker_lost_budget_spent(self, state: RolloutState) -> RunResult | None:
        """A takeover is a lost worker too: if this one spends the rollout's worker-lost budget,
        record the abort and ``Failed`` (worker_lost) instead of opening another attempt."""
        lost = await worker_lost_aborts(self.store, state.rollout_id) + 1
        if lost < self.max_worker_lost:
            return None
        error = (
            f"{lost} workers were lost under this rollout (limit {self.max_worker_lost}); "
            f"the last, {state.worker_id}, was taken over by {self.worker_id}"
        )
        [abort] = commands.abort(state, AbortReason.WORKER_LOST, f"taken over by {self.worker_id}")
        done = await record_failure(
            self.store, state, error, FailureClass.WORKER_LOST, before=[abort],
            worker_id=self.worker_id,
        )  # fmt: skip
        self.stats.takeovers += 1
        self.stats.aborted(AbortReason.WORKER_LOST)
        self.stats.end(Status.FAILED, FailureClass.WORKER_LOST)
        return RunResult(Outcome.FAILED, done, error)

    async def _cancel_stale(self, state: RolloutState) -> RunResult:
        # Policy: a rollout is never (re)started on weights beyond its staleness bound; it ends
        # as cancelled with the reason. Tokens it already has stay in the log.
        reason = (
            f"stale: weights v{self.engine.weight_version} are more than "
            f"{state.request.max_staleness} versions ahead of v{state.admitted_version}"
        )
        # Cancelled is legal from any non-terminal state and ends a live attempt's fence too.
        try:
            done = await self.checkpointer.append(state, [commands.cancel(state, reason)])
        except AppendRefused:
            # Someone else moved it on meanwhile; nothing of ours to record.
            return RunResult(Outcome.LOST, await self.store.load(state.rollout_id))
        self.stats.end(Status.CANCELLED)
        log_event(
            log, logging.INFO, "finish", f"rollout {state.rollout_id} cancelled: {reason}",
            rollout_id=state.rollout_id, attempt=state.attempt, worker=self.worker_id,
            status=Status.CANCELLED.value, reason="stale",
        )  # fmt: skip
        return RunResult(Outcome.FINISHED, done)

    async def _begin(self, state: RolloutState) -> RolloutState:
        events = commands.begin(
            state,
            worker_id=self.worker_id,
            weight_version=self.engine.weight_version,
            weight_mode=self.weight_mode,
            model=self.model_id,
        )
        began = await self.checkpointer.append(state, events)
        self._log_begin(state, began)
        return began

    def _log_begin(self, before: RolloutState, began: RolloutState) -> None:
        """Count and log how the attempt began: over a live attempt whose lease lapsed (a
        takeover), from saved tokens (a resume), or from the prompt."""
        rid, version = began.rollout_id, self.engine.weight_version
        if before.status in LIVE:
            # rq ran this job while an attempt was live (a duplicate delivery, or its worker
            # died): taken over. The old attempt is fenced out from this append on.
            self.stats.takeovers += 1
            self.stats.aborted(AbortReason.WORKER_LOST)
            log_event(
                log, logging.WARNING, "takeover",
                f"rollout {rid} attempt {before.attempt}: taking over from worker "
                f"{before.worker_id} (its lease lapsed)",
                rollout_id=rid, attempt=began.attempt, worker=self.worker_id,
                from_worker=before.worker_id, reason=AbortReason.WORKER_LOST.value,
            )  # fmt: skip
        if before.num_tokens:
            self.stats.resumes += 1
            log_event(
                log, logging.INFO, "resume",
                f"rollout {rid} attempt {began.attempt}: resumed from {before.num_tokens} saved "
                f"tokens on weights v{version}",
                rollout_id=rid, attempt=began.attempt, worker=self.worker_id,
                tokens=before.num_tokens, weight_version=version,
            )  # fmt: skip
        else:
            log_event(
                log, logging.INFO, "rollout_start",
                f"rollout {rid} attempt {began.attempt}: started on weights v{version}",
                rollout_id=rid, attempt=began.attempt, worker=self.worker_id,
                weight_version=version,
            )  # fmt: skip

    async def _generate(self, state: RolloutState, attempt: _Attempt) -> RunResult:
        rid = state.rollout_id
        request = EngineRequest(
            request_id=f"{rid}#{state.attempt}",
            prompt_token_ids=state.resume_prompt(),
            sampling=state.resume_sampling(),
            resumed_tokens=state.num_tokens,
        )
        limits = self.engine.limits
        try:
            # Checked here, not only by the engine: every engine is held to the same rules, and
            # a refused request never reaches it.
            check_request(request, limits, context_name="context_length")
        except RequestRejected as exc:
            return await self._reject(state, None, exc)
        request = fit_to_context(request, limits)
        if attempt.place is not None:
            # Begun (and leased) while the rollout before it finished: wait for its place. A
            # stop meanwhile aborts the request right after it opens, as below.
            await attempt.place.enter()
        attempt.request_id = request.request_id
        if self.stepper is not None:
            return await self._generate_stepped(state, attempt, request, self.stepper)
        return await self._generate_streamed(state, attempt, request)

    async def _generate_streamed(
        self, state: RolloutState, attempt: _Attempt, request: EngineRequest
    ) -> RunResult:
        """``_generate`` on one ``generate`` stream of the engine's, in this rollout's task."""
        rid = state.rollout_id
        if attempt.stop is not None:
            # stop() came while the attempt was being opened, before there was a request.
            await self.engine.abort(request.request_id)
        buffer: list[Chunk] = []
        buffered = 0
        commits = self.checkpointer
        flushed = commits.flush_point()
        in_flight: asyncio.Task[RolloutState] | None = None
        # Tokens to go before the place is nearly free (None: told, or never told).
        to_go = request.sampling.max_tokens - self.prefetch_tokens if self.prefetch_tokens else None
        if to_go is not None and to_go <= 0:
            attempt.nearly_free()  # short from the start, as Stepper.open tells it
            to_go = None
        try:
            with commits.streaming():  # a flush point waits for this stream until it ends
                async for chunk in self.engine.generate(request):
                    buffer.append(chunk)
                    buffered += len(chunk.token_ids)
                    if chunk.finish_reason is not None:
                        break
                    if to_go is not None:
                        to_go -= len(chunk.token_ids)
                        if to_go <= 0:
                            attempt.nearly_free()
                            to_go = None
                    ready = in_flight is None or in_flight.done()
                    point = commits.flush_due(buffered, flushed, ready=ready)
                    if point is not None:
                        if in_flight is not None:
                            state = in_flight.result()
                        in_flight = asyncio.create_task(self._checkpoint(state, buffer))
                        buffer, buffered, flushed = [], 0, point
        except EngineError as exc:
            state = await self._settle(in_flight, state)
            return await self._ended_by(exc, state, _joined(buffer), attempt)
        except BaseException:
            # Cancelled (the worker is going down hard) or a bug: stop generating for it.
            await self.engine.abort(request.request_id)
            raise
        state = await self._settle(in_flight, state)
        last = buffer[-1] if buffer else None
        if last is None or last.finish_reason is None:
            raise EngineError(f"engine stream for {rid} ended without a finish reason")
        done = await self._finish(
            attempt, state, _joined(buffer), last.finish_reason, last.stop_reason
        )
        return RunResult(Outcome.FINISHED, done)

    async def _generate_stepped(
        self, state: RolloutState, attempt: _Attempt, request: EngineRequest, stepper: Stepper
    ) -> RunResult:
        """``_generate`` on the worker's stepper: the stepper buffers and checkpoints this
        rollout's tokens with every other's; this task wakes only when its stream ends."""
        track: Track | None = None
        try:
            near = attempt.nearly_free if self.prefetch_tokens else None
            track = await stepper.open(state, request, nearly_free=near)
            if attempt.stop is not None:
                # stop() came while the attempt was being opened, before there was a request.
                await stepper.abort(request.request_id)
            try:
                end = await track.ended
            except EngineError as exc:
                state, rest = await stepper.settle(track)
                return await self._ended_by(exc, state, rest, attempt)
            state, rest = await stepper.settle(track)
        except BaseException:
            # Cancelled, fenced out (AppendRefused, raised on by ``_run``), Redis gone or a
            # bug: stop generating for it.
            await stepper.abort(request.request_id)
            if track is not None:
                stepper.release(track)
            raise
        assert end.finish_reason is not None  # an End without an error is a finish
        done = await self._finish(attempt, state, rest, end.finish_reason, end.stop_reason)
        return RunResult(Outcome.FINISHED, done)

    async def _ended_by(
        self, exc: EngineError, state: RolloutState, rest: Joined | None, attempt: _Attempt
    ) -> RunResult:
        """Record how an engine error ended the stream, with the tokens not yet saved."""
        if isinstance(exc, RequestAborted):
            reason, detail = attempt.stop or (AbortReason.SHUTDOWN, "")
            return RunResult(Outcome.ABORTED, await self._abort(state, rest, reason, detail))
        if isinstance(exc, RequestRejected):
            # The engine refuses the request itself: no worker of this model would serve it.
            return await self._reject(state, rest, exc)
        if isinstance(exc, EngineDead):
            # Not this rollout's fault: save it and give it back; the worker stops. Its own
            # reason, so that it is never charged to the rollout's engine-error budget.
            error = f"{EngineDead.__name__}: {exc}"
            state = await self._abort(state, rest, AbortReason.ENGINE_DEAD, error)
            return RunResult(Outcome.ENGINE_DEAD, state, error)
        error = f"{type(exc).__name__}: {exc}"
        state = await self._abort(state, rest, AbortReason.ENGINE_ERROR, error)
        return RunResult(Outcome.ENGINE_ERROR, state, error)

    async def _reject(
        self, state: RolloutState, rest: Joined | None, exc: RequestRejected
    ) -> RunResult:
        """Fail the rollout at once as a request error (any tokens it has are kept)."""
        error = f"{type(exc).__name__}: {exc}"
        tokens = None if rest is None else self._new_tokens(rest)
        before = [] if tokens is None else [commands.checkpoint(state, tokens)]
        done = await record_failure(
            self.store, state, error, FailureClass.REQUEST_ERROR, before=before,
            worker_id=self.worker_id,
        )  # fmt: skip
        self.stats.end(Status.FAILED, FailureClass.REQUEST_ERROR)
        return RunResult(Outcome.FAILED, done, error)

    async def _settle(
        self, in_flight: asyncio.Task[RolloutState] | None, state: RolloutState
    ) -> RolloutState:
        return state if in_flight is None else await in_flight

    async def _checkpoint(self, state: RolloutState, chunks: list[Chunk]) -> RolloutState:
        # A flush point's checkpoint always carries tokens.
        event = commands.checkpoint(state, self._new_tokens(join_chunks(chunks)))
        state = await self.checkpointer.append(state, [event], gather=True)
        self._saved()
        return state

    def _saved(self) -> None:
        self.stats.checkpoints += 1

    async def _finish(
        self,
        attempt: _Attempt,
        state: RolloutState,
        rest: Joined | None,
        reason: FinishReason,
        stop_reason: int | str | None,
    ) -> RolloutState:
        tokens = None if rest is None else self._new_tokens(rest)
        events = commands.finish(state, reason, stop_reason, tokens=tokens)
        # The next rollout may start once these are stamped. Aborts keep their slot until
        # saved: an abort may be the engine dying or the worker stopping, and a slot freed
        # then would only take another job to abort.
        attempt.free_engine()
        done = await self.checkpointer.append(state, events)
        self.stats.end(Status.DONE)
        # One line per rollout, not per token: ~60 us each with the JSON formatter (measured
        # on the 2-core CI machine), so under 1% of a core at tens of rollouts a second.
        log_event(
            log, logging.INFO, "finish",
            f"rollout {done.rollout_id} attempt {done.attempt}: done ({reason.value}), "
            f"{done.num_tokens} tokens",
            rollout_id=done.rollout_id, attempt=done.attempt, worker=self.worker_id,
            status=Status.DONE.value, finish_reason=reason.value, tokens=done.num_tokens,
        )  # fmt: skip
        return done

    async def _abort(
        self, state: RolloutState, rest: Joined | None, reason: AbortReason, detail: str
    ) -> RolloutState:
        tokens = None if rest is None else self._new_tokens(rest)
        events = commands.abort(state, reason, detail, tokens=tokens)
        state = await self.checkpointer.append(state, events)
        self.stats.aborted(reason)
        log_event(
            log, logging.INFO, "abort",
            f"rollout {state.rollout_id} attempt {state.attempt} aborted on {self.worker_id} "
            f"({reason.value}{f': {detail}' if detail else ''}): {state.num_tokens} tokens kept",
            rollout_id=state.rollout_id, attempt=state.attempt, worker=self.worker_id,
            reason=reason.value, tokens=state.num_tokens,
        )  # fmt: skip
        return state

    def _new_tokens(self, joined: Joined) -> NewTokens:
        """Tokens as the domain records them: logprobs clamped and counted."""
        logprobs, nonfinite = clamp_logprobs(joined.logprobs)
        self.stats.tokens += len(joined.token_ids)
        self.stats.nonfinite_logprobs += nonfinite
        return NewTokens(
            token_ids=joined.token_ids,
            logprobs=logprobs,
            weight_versions=joined.weight_versions,
            routed_experts=joined.routed_experts,
            nonfinite_logprobs=nonfinite,
        )


def _joined(chunks: list[Chunk]) -> Joined | None:
    return join_chunks(chunks) if chunks else None


def offers_steps(engine: Engine) -> bool:
    """Whether the engine's own class gives whole steps (``StepEngine``) that match its
    ``generate``: a subclass that changes what ``generate`` yields (a test double that injects
    NaN logprobs, paces tokens or wraps another engine) keeps the per-rollout streams, which is
    where its change shows."""
    mro = type(engine).__mro__
    gen, add, steps = (
        next((c for c in mro if name in vars(c)), object) for name in ("generate", "add", "steps")
    )
    return object not in (add, steps) and issubclass(steps, gen) and issubclass(add, gen)
