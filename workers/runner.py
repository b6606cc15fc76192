"""One attempt of one rollout on an engine, recorded durably as it goes: its opening.

The runner loads the rollout, refuses a job that is not its to run (wrong queue, wrong model,
a live attempt elsewhere), takes the rollout's lease, and opens an attempt (the domain's
``commands.begin``): over a live attempt whose lease lapsed (a takeover), from saved tokens (a
resume), or from the prompt. The opened attempt then generates on the engine
(``workers.generation``): its tokens go to the worker's group-commit ``Checkpointer`` as they
come, and the last checkpoint and ``Finished`` (or ``Aborted``) go together in one chain.
Each round trip costs syscalls, wake-ups and an fsync (AOF ``always``) on the cores the engine
shares, which is why the worker's rollouts share them.
"""

from __future__ import annotations

import asyncio
import logging
import time

from statemachine import (
    AT_TOOL,
    LIVE,
    AbortReason,
    FailureClass,
    FinishReason,
    RolloutState,
    Status,
    commands,
    episode_commands,
)
from statemachine.errors import ModelMismatch
from store import AppendRefused, EventStore, defaults
from store.coalesce import Coalescer
from store.leases import Leases
from store.logs import log_event
from store.scripts import Step
from store.since import Held, load_held
from workers import own_attempt, turns
from workers.checkpoint import Cadence, Checkpointer
from workers.engines.base import Engine
from workers.engines.inflight import context_full
from workers.failures import record_failure, worker_lost_aborts
from workers.generation import Attempt, Generation
from workers.outcomes import Outcome, RunResult, Stats
from workers.places import EnginePlace
from workers.stepper import Stepper

log = logging.getLogger("rollouts.runner")


def _wrong_model(recorded: str, ours: str) -> str:
    return f"earlier attempts ran model {recorded!r}; this worker runs {ours!r}"


# Outcomes after which the rollout's lease, if any, belongs to another attempt (or was never
# taken): dropping it would let the reaper abort a live attempt elsewhere.
_NOT_OURS = frozenset({Outcome.LOST, Outcome.DUPLICATE, Outcome.WRONG_QUEUE, Outcome.WRONG_MODEL})


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
        keep_turns: int = 0,
    ) -> None:
        """``keep_turns``: episodes to hold between their turns (``store.since``; 0: none).
        ``prefetch_tokens``: when a rollout has that many tokens left, its place's
        ``nearly_free`` is called (0: never). ``stepped``: stream through the engine's steps
        (``workers.stepper``) rather than one ``generate`` stream per rollout; None: whenever
        the engine offers them (``generation.offers_steps``), the default; False: the
        per-rollout streams (an engine without steps, such as vLLM over HTTP, always runs that
        way)."""
        self.store = store
        self.checkpointer = checkpointer
        # Writes Redis refuses for a condition of its own wait it out (the Checkpointer's own
        # appends do too): the attempt, its lease and its tokens are kept, no budget charged.
        self.condition = checkpointer.condition
        self.engine = engine
        self.worker_id = worker_id
        self.stats = stats or Stats()
        self.weight_mode = weight_mode
        self.leases = leases
        self.lease_ttl_s = lease_ttl_s
        # A rollout's first load, its lease and the lease's drop: each is one round trip of
        # its own per rollout, and many rollouts start and end together (store.coalesce).
        self._load = Coalescer(store.load_many)
        # Episodes whose turn ended here at a tool call, as that turn's last append left them
        # (oldest first, at most ``keep_turns``): their next turn here reads only the log's
        # entries since (``store.since``).
        self._held: dict[str, Held] = {}
        self.keep_turns = keep_turns
        self._load_held: Coalescer[Held, RolloutState] = Coalescer(
            lambda held: load_held(store, held)
        )
        if leases is not None:
            self.take_lease: Coalescer[str, None] = Coalescer(
                lambda ids: leases.take_many(ids, self.lease_ttl_s)
            )
            self._drop = Coalescer(leases.drop_many)
            self._forget = Coalescer(leases.forget_many)
        self.max_worker_lost = max_worker_lost
        self.prefetch_tokens = prefetch_tokens
        # What every attempt records as its model; the engine's own identity unless the
        # deployment names it (e.g. vLLM servers whose model directory is not mounted here).
        self.model_id = engine.model_id if model_id is None else model_id
        if cadence is not None:
            checkpointer.cadence = cadence
        # The engine side of every attempt, once begun (``workers.generation``).
        self.generation = Generation(
            store, checkpointer, engine, worker_id, self.stats,
            stepped=stepped, prefetch_tokens=prefetch_tokens,
        )  # fmt: skip
        self._attempts: dict[str, Attempt] = {}  # rollouts inside run()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def cadence(self) -> Cadence:
        return self.checkpointer.cadence

    @property
    def stepper(self) -> Stepper | None:
        """The worker's stepper, if its attempts stream through the engine's steps."""
        return self.generation.stepper

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
            await self.generation.abort_request(attempt.request_id)

    def _end_on_budget(self, attempt: Attempt, reason: FinishReason) -> None:
        """A budget ran out mid-stream: abort the attempt's request so that it finishes with
        ``reason`` (``Generation._ended_by``). Nothing if a stop came first."""
        if attempt.stopping:
            return
        attempt.finish_on = reason
        if attempt.request_id is not None:
            # Held by the attempt: a task only the loop references may be collected mid-run.
            attempt.ending = asyncio.ensure_future(
                self.generation.abort_request(attempt.request_id)
            )

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
        while (previous := self._attempts.get(rollout_id)) is not None:
            state = await self._load(rollout_id)
            if state.status is not Status.NEXT_TURN:
                # rq delivered the job again to this very worker (its execution looked
                # abandoned to a sweep, e.g. stamped by this host's clock stepped back): a
                # duplicate. The record stays the live run's: the heartbeat renews the leases
                # of the rollouts recorded here, and a stop reaches the run through it.
                # Replaced and then deleted by this copy, the live run's lease lapsed and was
                # reaped.
                return RunResult(Outcome.DUPLICATE, state)
            # An episode's next turn, whose job came (a quick tool's result pushes it) while
            # the last turn's run still winds up here: not a duplicate, the turn to run next.
            await previous.ended.wait()
        attempt = self._attempts[rollout_id] = Attempt(place)
        self._idle.clear()
        try:
            result = await self._run(rollout_id, queue, attempt)
            if result.outcome is Outcome.TOOL_CALL and result.state.status in AT_TOOL:
                self._hold(result)
            if (
                self.leases is not None
                and result.outcome is Outcome.TOOL_CALL
                and (result.state.status in AT_TOOL)
            ):
                # A turn that ended at a tool call: its lease went in the step that ended it
                # (lua/tool_call_index.lua), and whatever holds one under this id now holds the
                # next turn's. Only this worker's set still names it.
                await self.condition.until_written(
                    lambda: self._forget(rollout_id), "lease drop", proves=False
                )
            elif self.leases is not None and (
                result.outcome not in _NOT_OURS or result.state.terminal
            ):
                # Our attempt is over: the lease goes before the job is handed back, so that the
                # next worker's lease is never the one we drop. An ended rollout (e.g. cancelled
                # under us: LOST) takes no lease ever again, so its lease is nobody's. A delete
                # is allowed out of memory, so it proves nothing about an episode's end.
                await self.condition.until_written(
                    lambda: self._drop(rollout_id), "lease drop", proves=False
                )
            return result
        finally:
            attempt.ended.set()
            if self._attempts.get(rollout_id) is attempt:  # not a later run's record
                del self._attempts[rollout_id]
            if not self._attempts:
                self._idle.set()

    def _hold(self, result: RunResult) -> None:
        if not self.keep_turns or result.record is None:
            return
        rid = result.state.rollout_id
        self._held.pop(rid, None)
        self._held[rid] = Held(result.state, result.record)
        while len(self._held) > self.keep_turns:
            # The oldest: its next turn went to another worker, or its tool is slow.
            del self._held[next(iter(self._held))]

    async def _load_turn(self, rollout_id: str) -> RolloutState:
        held = self._held.pop(rollout_id, None)
        if held is None:
            return await self._load(rollout_id)
        return await self._load_held(held)

    def _not_to_run(self, state: RolloutState, queue: str | None) -> RunResult | None:
        """Why this job is not to be run here, judged before anything is written."""
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
        if state.status in AT_TOOL:
            # An episode waiting on its tool call has no turn to run until the result is
            # recorded (which pushes the next turn's job): this job is a stale duplicate.
            return RunResult(Outcome.DUPLICATE, state)
        return None

    async def _run(self, rollout_id: str, queue: str | None, attempt: Attempt) -> RunResult:
        state = await self._load_turn(rollout_id)
        refused = self._not_to_run(state, queue)
        if refused is not None:
            return refused
        if state.too_stale(self.engine.weight_version):
            return await self._cancel_stale(state)
        if self.leases is not None and state.status in LIVE and state.worker_id == self.worker_id:
            own = await own_attempt.take_back(self, state, attempt)  # a failed run left it
            if isinstance(own, RunResult):
                return own
            state = own
        lease = await self._lease(state)
        if isinstance(lease, RunResult):
            return lease
        try:
            if state.status in LIVE:
                spent = await self._worker_lost_budget_spent(state)
                if spent is not None:
                    return spent
            if state.status is Status.NEXT_TURN:
                # A budget may have run out while the episode waited (its wall time): no turn
                # begins then; the episode ends with the budget's reason.
                ended = episode_commands.end_on_budget(state, time.time())
                if ended:
                    done = await self.checkpointer.append(state, ended)
                    self.stats.end(done.status)
                    return RunResult(Outcome.FINISHED, done)
            try:
                state = await self._begin(state, lease)
            except ModelMismatch:
                # Another attempt began on a different model since we loaded it; the lease
                # is that attempt's now (its heartbeats renew it), so it is not ours to drop.
                state = await self.store.load(rollout_id)
                return RunResult(
                    Outcome.WRONG_MODEL, state, _wrong_model(state.model, self.model_id)
                )
            return await self.generate_or_end(state, attempt)
        except AppendRefused:
            # Fenced out: our attempt is no longer the live one. Someone else owns it now.
            return RunResult(Outcome.LOST, await self.store.load(rollout_id))

    async def _lease(self, state: RolloutState) -> list[Step] | RunResult:
        """The attempt's lease, taken now, or as steps of the transaction that opens the
        attempt; or ``DUPLICATE`` when a live worker holds it."""
        rid = state.rollout_id
        if self.leases is None:
            return []
        if state.status in LIVE:
            # Judged by Redis's clock, as the reaper judges it: never this host's.
            left = await self.leases.left_ms(rid)
            if left is not None and left > 0:
                # A live worker is generating it (rq delivered the job twice): leave it be.
                return RunResult(Outcome.DUPLICATE, state)
        if state.status in LIVE or self.store.cluster:
            # A takeover (whose worker-lost budget may end the rollout instead), or Redis
            # Cluster (the lease index in another slot than the rollout): the lease first, the
            # attempt second. A crash in between leaves a lease the reaper turns into a
            # re-enqueue, never a live attempt nobody watches.
            await self.condition.until_written(lambda: self.take_lease(rid), "lease")
            return []
        # Taken in the transaction that opens the attempt: never one without the other, and
        # one round trip less per attempt (an episode's every turn: bench_episodes).
        return self.leases.take_steps([rid], self.lease_ttl_s)

    async def generate_or_end(self, state: RolloutState, attempt: Attempt) -> RunResult:
        """The begun attempt's generation, or its end at once when a budget leaves it none."""
        wall_left = turns.wall_time_left(state, time.time())
        if wall_left is not None and wall_left <= 0:
            # An episode's wall time ran out while it waited for a worker (pending, aborted or
            # between turns): it ends with what it has, without the engine.
            done = await self.generation.finish(attempt, state, None, FinishReason.WALL_TIME, None)
            return RunResult(Outcome.FINISHED, done)
        if state.remaining_tokens == 0 or context_full(state, self.engine.limits):
            # The budget was used up before an abort, or a capped rollout filled the context:
            # finish without asking the engine.
            reason = turns.length_reason(state, 0)
            # (A harness-driven episode's turn ends there: its next call may bring more.)
            return await self.generation.end_turn(attempt, state, None, reason, None)
        if wall_left is None:
            return await self.generation.generate(state, attempt)
        # The turn is cut at the wall-time deadline: its tokens so far are kept and the
        # episode finishes with that reason.
        timer = asyncio.get_running_loop().call_later(
            wall_left, self._end_on_budget, attempt, FinishReason.WALL_TIME
        )
        try:
            return await self.generation.generate(state, attempt)
        finally:
            timer.cancel()

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
        done = await self.condition.until_written(lambda: record_failure(
            self.store, state, error, FailureClass.WORKER_LOST, before=[abort],
            worker_id=self.worker_id,
        ), "failure")  # fmt: skip
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

    async def _begin(self, state: RolloutState, lease: list[Step]) -> RolloutState:
        events = commands.begin(
            state,
            worker_id=self.worker_id,
            weight_version=self.engine.weight_version,
            weight_mode=self.weight_mode,
            model=self.model_id,
        )
        began = await self.checkpointer.append(state, events, before=lease)
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
        if before.status is Status.NEXT_TURN:
            log_event(
                log, logging.INFO, "turn_start",
                f"rollout {rid} attempt {began.attempt}: turn {len(before.calls) + 1} started "
                f"on weights v{version}, {before.context_tokens} context tokens",
                rollout_id=rid, attempt=began.attempt, worker=self.worker_id,
                tokens=before.num_tokens, weight_version=version,
            )  # fmt: skip
        elif before.num_tokens:
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
