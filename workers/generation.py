"""The generating half of an attempt: an opened attempt's request on the engine, its tokens
recorded as they come, and its end (finished, aborted, rejected) recorded with the tokens not
yet saved.

Tokens stream into a buffer and go to the worker's group-commit ``Checkpointer`` whenever its
flush-point policy (``Checkpointer.flush_due``) says so. Generation never waits for Redis:
while one checkpoint is in flight the next tokens keep buffering. The last checkpoint and
``Finished`` (or ``Aborted``) go together in one chain. Two ways to stream: one ``generate``
stream per rollout in its own task (``_generate_streamed``), or the engine's whole steps
through the worker's ``Stepper`` (``_generate_stepped``), where one loop buffers and
checkpoints every rollout's tokens.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from statemachine import (
    AbortReason,
    FailureClass,
    FinishReason,
    RolloutState,
    Status,
    codec,
    commands,
    episode_commands,
    harness_commands,
)
from statemachine.arrays import clamp_logprobs
from statemachine.commands import NewTokens
from statemachine.status import EPISODE_FINISH
from store import EventStore
from store.logs import log_event
from workers import turns
from workers.checkpoint import Checkpointer
from workers.engines.base import Chunk, Engine, EngineRequest, Joined, StepEngine, join_chunks
from workers.engines.errors import EngineDead, EngineError, RequestAborted, RequestRejected
from workers.engines.inflight import check_request, fit_to_context
from workers.failures import record_failure
from workers.outcomes import Outcome, RunResult, Stats
from workers.places import EnginePlace
from workers.stepper import Stepper, Track

log = logging.getLogger("rollouts.runner")
_UNSET: Any = object()


@dataclass(slots=True)
class Attempt:
    """What the runner knows of one rollout while it is inside ``RolloutRunner.run``."""

    place: EnginePlace | None  # see ``RolloutRunner.run``
    request_id: str | None = None  # the engine request, once there is one
    stop: tuple[AbortReason, str] | None = None  # why ``stop`` was asked, if it was
    # A budget that ends the rollout mid-stream (an episode's wall time): its request is
    # aborted, and the tokens so far are kept and finished with this reason, not aborted.
    finish_on: FinishReason | None = None
    ending: asyncio.Future[None] | None = None  # the abort ``finish_on`` sent, while it runs
    freed: bool = False
    ended: asyncio.Event = field(default_factory=asyncio.Event)  # set when ``run`` returns

    @property
    def stopping(self) -> bool:
        """Whether the attempt's request is to be aborted (to save and give back, or to end)."""
        return self.stop is not None or self.finish_on is not None

    def nearly_free(self) -> None:
        if self.place is not None:
            self.place.nearly_free()

    def free_engine(self) -> None:
        if self.place is not None and not self.freed:
            self.freed = True
            self.place.free()


class Generation:
    """The engine side of the runner's attempts (``RolloutRunner`` opens them and hands each
    here once begun). Counts what it records in ``stats``."""

    def __init__(
        self,
        store: EventStore,
        checkpointer: Checkpointer,
        engine: Engine,
        worker_id: str,
        stats: Stats,
        *,
        stepped: bool | None = None,
        prefetch_tokens: int = 0,
    ) -> None:
        """``stepped`` and ``prefetch_tokens``: as ``RolloutRunner`` takes them."""
        self.store = store
        self.checkpointer = checkpointer
        self.condition = checkpointer.condition
        self.engine = engine
        self.worker_id = worker_id
        self.stats = stats
        self.prefetch_tokens = prefetch_tokens
        self.stepper: Stepper | None = None
        self._tokenizer: Any = _UNSET  # looked up at the first episode that needs it
        if stepped if stepped is not None else offers_steps(engine):
            assert isinstance(engine, StepEngine), f"{type(engine).__name__} has no steps"
            self.stepper = Stepper(
                engine, checkpointer, self._new_tokens, self._saved, ahead=prefetch_tokens
            )

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer, for an episode's tool-call parser: the engine's own where it
        has one (the CPU engine), else loaded from the engine's model directory once; None
        when neither is there (vLLM servers whose model directory is not mounted here)."""
        if self._tokenizer is _UNSET:
            self._tokenizer = turns.engine_tokenizer(self.engine)
        return self._tokenizer

    def _parser_tokenizer(self, state: RolloutState) -> Any:
        """The tokenizer, for an episode that names a tool-call parser only (loading one takes
        seconds: never for a plain rollout)."""
        episode = state.request.episode
        return None if episode is None or episode.parser is None else self.tokenizer

    async def abort_request(self, request_id: str) -> None:
        if self.stepper is not None:
            await self.stepper.abort(request_id)
        else:
            await self.engine.abort(request_id)

    async def generate(self, state: RolloutState, attempt: Attempt) -> RunResult:
        rid = state.rollout_id
        tokenizer = self._parser_tokenizer(state)
        unserved = turns.unserved_parser(state, tokenizer)
        if unserved is not None:
            return await self._reject(state, None, RequestRejected(unserved))
        request = EngineRequest(
            request_id=f"{rid}#{state.attempt}",
            prompt_token_ids=state.resume_prompt(),
            sampling=turns.turn_sampling(state, tokenizer),
            resumed_tokens=turns.turn_tokens(state),
            prompt_routes_from=turns.observation_routes_from(state),
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
        self, state: RolloutState, attempt: Attempt, request: EngineRequest
    ) -> RunResult:
        """``generate`` on one ``generate`` stream of the engine's, in this rollout's task."""
        rid = state.rollout_id
        if attempt.stopping:
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
        return await self.end_turn(
            attempt, state, _joined(buffer), last.finish_reason, last.stop_reason
        )

    async def _generate_stepped(
        self, state: RolloutState, attempt: Attempt, request: EngineRequest, stepper: Stepper
    ) -> RunResult:
        """``generate`` on the worker's stepper: the stepper buffers and checkpoints this
        rollout's tokens with every other's; this task wakes only when its stream ends."""
        track: Track | None = None
        try:
            near = attempt.nearly_free if self.prefetch_tokens else None
            track = await stepper.open(state, request, nearly_free=near)
            if attempt.stopping:
                # stop() came while the attempt was being opened, before there was a request.
                await stepper.abort(request.request_id)
            try:
                end = await track.ended
            except EngineError as exc:
                state, rest = await stepper.settle(track)
                return await self._ended_by(exc, state, rest, attempt)
            state, rest = await stepper.settle(track)
        except BaseException:
            # Cancelled, fenced out (AppendRefused, raised on by ``RolloutRunner._run``), Redis
            # gone or a bug: stop generating for it.
            await stepper.abort(request.request_id)
            if track is not None:
                stepper.release(track)
            raise
        assert end.finish_reason is not None  # an End without an error is a finish
        return await self.end_turn(attempt, state, rest, end.finish_reason, end.stop_reason)

    async def _ended_by(
        self, exc: EngineError, state: RolloutState, rest: Joined | None, attempt: Attempt
    ) -> RunResult:
        """Record how an engine error ended the stream, with the tokens not yet saved."""
        if isinstance(exc, RequestAborted):
            if attempt.finish_on is not None and attempt.stop is None:
                # Our own abort for a budget: the rollout ends here with what it has. (An
                # abort to save and give back, asked first, stays one: whoever takes the
                # rollout next finds the budget spent when it begins.)
                done = await self.finish(attempt, state, rest, attempt.finish_on, None)
                return RunResult(Outcome.FINISHED, done)
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
        done = await self.condition.until_written(lambda: record_failure(
            self.store, state, error, FailureClass.REQUEST_ERROR, before=before,
            worker_id=self.worker_id,
        ), "failure")  # fmt: skip
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

    async def end_turn(
        self,
        attempt: Attempt,
        state: RolloutState,
        rest: Joined | None,
        reason: FinishReason,
        stop_reason: int | str | None,
    ) -> RunResult:
        """The engine ended the attempt's stream with ``reason``: an episode's turn that
        stopped at a tool call records the call, anything else finishes the rollout."""
        episode = state.request.episode
        if reason is FinishReason.LENGTH:
            reason = turns.length_reason(state, 0 if rest is None else len(rest.token_ids))
        if state.harness and reason not in EPISODE_FINISH:
            # A harness-driven episode's turn ends wherever its generation does: the harness
            # decides what follows, from the answer its call gets.
            return await self._record_turn_end(
                attempt, state, harness_commands.end_turn(
                    state, reason, stop_reason, now=time.time(),
                    tokens=None if rest is None else self._new_tokens(rest)),
                turns.turn_tokens(state) + (0 if rest is None else len(rest.token_ids)),
            )  # fmt: skip
        call = None
        tokenizer = self._parser_tokenizer(state)
        if episode is not None and turns.stopped_at_call(episode, reason, stop_reason, tokenizer):
            assert stop_reason is not None  # stopped_at_call says so
            turn = state.token_ids[state.num_tokens - turns.turn_tokens(state) :].tolist()
            if rest is not None:
                turn += rest.token_ids.tolist()
            call = turns.call_of(episode, stop_reason, turn, tokenizer)
        if call is None:
            return RunResult(
                Outcome.FINISHED, await self.finish(attempt, state, rest, reason, stop_reason)
            )
        name, arguments = call
        tokens = None if rest is None else self._new_tokens(rest)
        events = episode_commands.request_call(
            state, name=name, arguments=arguments, tokens=tokens, now=time.time()
        )
        return await self._record_turn_end(attempt, state, events, len(turn))

    async def _record_turn_end(
        self, attempt: Attempt, state: RolloutState, events: list[Any], tokens: int
    ) -> RunResult:
        """Append the end of an episode's turn (its last tokens and its call), which frees
        the engine as a finish does: the turn is over for it."""
        attempt.free_engine()
        done = await self.checkpointer.append(state, events)
        self.stats.tool_calls += 1
        if done.terminal:  # a budget left the call no use: the episode ended with it
            self.stats.end(done.status)
        made = done.calls[-1]
        log_event(
            log, logging.INFO, "tool_call",
            f"rollout {done.rollout_id} attempt {done.attempt}: turn {made.turn + 1} ended at "
            f"tool call {made.call_id} ({made.name}) after {tokens} tokens; "
            f"{done.status.value}",
            rollout_id=done.rollout_id, attempt=done.attempt, worker=self.worker_id,
            call_id=made.call_id, tool=made.name, tokens=done.num_tokens,
            status=done.status.value,
        )  # fmt: skip
        return RunResult(Outcome.TOOL_CALL, done, record=codec.encode(events[-1]))

    async def finish(
        self,
        attempt: Attempt,
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
        top = joined.top_logprobs
        if top is not None:
            # Stored as the sampled ones are (vLLM's server clamps them the same way); only the
            # sampled logprobs are counted, as ``nonfinite_logprobs`` says.
            top = clamp_logprobs(top)[0]
        return NewTokens(
            token_ids=joined.token_ids,
            logprobs=logprobs,
            weight_versions=joined.weight_versions,
            routed_experts=joined.routed_experts,
            nonfinite_logprobs=nonfinite,
            top_token_ids=joined.top_token_ids,
            top_logprobs=top,
            observation_routes=joined.prompt_routes,
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
