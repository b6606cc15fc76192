"""One loop for all of a worker's engine streams: each engine step, whole, into per-rollout
buffers, and the due rollouts' checkpoints handed to the group commit together.

With ``Engine.generate`` every token of every request costs an async-iterator step, a
``Chunk``, a flush-point check and a list append in the rollout's own task: at vLLM's cadence
(one token per request per engine step, hundreds of requests) that was most of the worker's
CPU (profile in bench/bench_overhead.py's docstring). A ``StepEngine`` hands over one step for
all its requests at once; here it costs a dict lookup per request and a few numpy scatters
into preallocated arrays (``workers.step_rows``: one row per rollout, grown by doubling,
drained at each checkpoint), and the rollout's task sleeps until its stream ends. A request's
prompt routes (an episode turn's observation, ``Step.prompt_routes``) wait on its track and
go with its first checkpoint.

The flush-point policy is the ``Checkpointer``'s (``workers/checkpoint.py``): a flush point
starts when a rollout that can checkpoint holds ``Cadence.tokens`` unsaved tokens, or
``Cadence.interval_s`` after the last point, and every rollout whose previous checkpoint is
not in flight joins it with what it has. Here the joiners are known at once (they all got
their tokens in the same step), so their checkpoints go to the group commit in one call and
out in one round trip without waiting to gather. What arrives while a rollout's checkpoint is
in flight goes in its next one. The runner takes a rollout's last unsaved tokens itself when
its stream ends (``settle``), for its ``Finished`` or ``Aborted`` chain, as before.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial

import numpy as np

from statemachine import Event, RolloutState, commands
from statemachine.commands import NewTokens
from workers.checkpoint import Checkpointer
from workers.engines.base import End, EngineRequest, Joined, Step, StepEngine
from workers.engines.errors import EngineError, RequestAborted
from workers.step_rows import Rows

log = logging.getLogger("rollouts.stepper")


@dataclass(eq=False)
class Track:
    """One attempt's stream inside the stepper."""

    request_id: str
    row: int
    state: RolloutState  # after its last saved checkpoint
    ended: asyncio.Future[End]  # its stream's end; the error its stream would have raised
    saving: asyncio.Future[RolloutState] | None = None  # its checkpoint in flight, if any
    point: int = 0  # the flush point it last joined (or that was current when it opened)
    added: bool = False  # the engine took the request
    released: bool = False
    # The engine's prompt routes for it (``Step.prompt_routes``), until its first checkpoint
    # takes them with its first tokens.
    prompt_routes: np.ndarray | None = None


class Stepper:
    """Streams of one worker's attempts on a ``StepEngine`` (see the module docstring)."""

    def __init__(
        self,
        engine: StepEngine,
        checkpointer: Checkpointer,
        to_tokens: Callable[[Joined], NewTokens],
        on_saved: Callable[[], None] | None = None,
        *,
        ahead: int = 0,
    ) -> None:
        """``ahead``: a track opened with ``nearly_free`` is told when it has that many tokens
        left (the runner's ``prefetch_tokens``)."""
        self.engine = engine
        self.checkpointer = checkpointer
        self.to_tokens = to_tokens  # the runner's: clamps logprobs, counts tokens
        self.on_saved = on_saved  # called per checkpoint saved (the worker's stats)
        self.steps = 0  # steps consumed (tests, benchmarks)
        self._rows = Rows()
        self._tracks: dict[str, Track] = {}  # streams not ended, by request id
        self._task: asyncio.Task[None] | None = None
        self._point = -1  # the flush point this stepper last checkpointed at
        self._joining = False  # the others join the current point at the next step
        self._pending: list[tuple[Track, tuple[RolloutState, list[Event]]]] = []
        self._timer: asyncio.TimerHandle | None = None
        self.ahead = ahead
        self._near: dict[int, Callable[[], None]] = {}  # by row: to tell at ``ahead`` to go

    async def open(
        self,
        state: RolloutState,
        request: EngineRequest,
        nearly_free: Callable[[], None] | None = None,
    ) -> Track:
        """Start the request on the engine. Never raises an engine's error: that ends the
        track (``Track.ended``), as it would end a ``generate`` stream. ``nearly_free`` is
        called once the request has ``ahead`` tokens or fewer left to generate."""
        rid = request.request_id
        row = self._rows.acquire(request.sampling.logprobs)
        track = Track(rid, row, state, asyncio.get_running_loop().create_future())
        # Like a stream that opens: it joins the next flush point, not the current one.
        track.point = self.checkpointer.flush_point()
        self._tracks[rid] = track
        try:
            await self.engine.add(request)
        except Exception as exc:
            # Refused or aborted before it ran: the stream's end, raised to whoever awaits it.
            self._end(track, End(error=exc))
            return track
        track.added = True
        if nearly_free is not None:
            left = request.sampling.max_tokens
            if left <= self.ahead:
                nearly_free()
            else:
                self._rows.left[track.row] = left
                self._near[track.row] = nearly_free
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="stepper")
        return track

    async def abort(self, request_id: str) -> None:
        """Abort the request; its track (if open) ends with ``RequestAborted`` at once and
        takes no more tokens. Idempotent, and an id not open yet is aborted in the engine,
        which remembers it."""
        track = self._tracks.get(request_id)
        if track is not None:
            self._end(track, End(error=RequestAborted(f"request {request_id!r} was aborted")))
        await self.engine.abort(request_id)

    async def settle(self, track: Track) -> tuple[RolloutState, Joined | None]:
        """After its stream ended: the state after its last checkpoint (awaited if in flight;
        its refusal is raised) and its unsaved tokens; the track's row is given back."""
        try:
            state = track.state if track.saving is None else await track.saving
            return state, self._unsaved(track)
        finally:
            self.release(track)

    def release(self, track: Track) -> None:
        """Give the track's row back (idempotent). A stream that had not ended (its runner is
        being cancelled) takes no more tokens."""
        self._end(track, None)
        if not track.released:
            track.released = True
            self._near.pop(track.row, None)
            self._rows.release(track.row)

    # ---- the loop --------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            async for step in self.engine.steps():
                self.steps += 1
                self._take(step)
        except Exception as exc:
            self._submit()
            # The engine died (EngineDead) or broke: every open stream ends with its error.
            log.debug("engine steps ended with %r", exc)
            for track in list(self._tracks.values()):
                self._end(track, End(error=type(exc)(str(exc)) if _copyable(exc) else exc))
            return
        self._submit()
        for track in list(self._tracks.values()):
            if track.added:
                # The engine has nothing in flight, yet never ended this stream: not left
                # hanging (a track still being added restarts the loop once it is).
                self._end(track, End(error=EngineError("engine steps ended without a finish")))

    def _take(self, step: Step) -> None:
        tracks, rows = self._tracks, self._rows
        full = False
        if step.counts is None:
            found = [t.row if (t := tracks.get(rid)) else -1 for rid in step.request_ids]
            at = np.array(found, dtype=np.intp)
            picks = None
            if len(at) and int(at.min()) < 0:
                # Late tokens of an ended (aborted) stream: dropped.
                picks = np.flatnonzero(at >= 0)
                at = at[picks]
            if len(at):
                fill = rows.put_ones(at, step, picks)
                due = fill >= self.checkpointer.cadence.tokens
                full = bool(due.any()) and not bool(rows.saving[at[due]].all())
                if self._near:
                    self._count_down(at)
        else:
            lo = 0
            for rid, n in zip(step.request_ids, step.counts.tolist(), strict=True):
                track = tracks.get(rid)
                if track is not None:
                    filled = rows.put(track.row, step, lo, lo + n)
                    full |= filled >= self.checkpointer.cadence.tokens and track.saving is None
                    if track.row in self._near:
                        self._count_down_row(track.row, n)
                lo += n
        if step.prompt_routes:
            self._keep_prompt_routes(step.prompt_routes)
        for rid, end in step.ends.items():
            track = tracks.get(rid)
            if track is not None:
                self._end(track, end)
        self._checkpoint(full)

    def _keep_prompt_routes(self, routes: Mapping[str, np.ndarray]) -> None:
        for rid, rows in routes.items():
            track = self._tracks.get(rid)
            if track is not None:
                track.prompt_routes = rows

    def _unsaved(self, track: Track) -> Joined | None:
        """The track's unsaved tokens (its row emptied), with its prompt routes if they are
        still to be saved (they go with the tokens that begin the stream)."""
        joined = self._rows.take(track.row)
        if joined is not None and track.prompt_routes is not None:
            joined = dataclasses.replace(joined, prompt_routes=track.prompt_routes)
            track.prompt_routes = None
        return joined

    def _count_down(self, rows: np.ndarray) -> None:
        """One more token for each of ``rows``; tell those now ``ahead`` of their end."""
        left = self._rows.left
        left[rows] -= 1
        for row in rows[left[rows] <= self.ahead].tolist():
            tell = self._near.pop(row, None)
            if tell is not None:
                tell()

    def _count_down_row(self, row: int, n: int) -> None:
        """``n`` more tokens for a row that is to be told (a step of several tokens each)."""
        left = int(self._rows.left[row]) - n
        self._rows.left[row] = left
        if left <= self.ahead:
            self._near.pop(row)()

    def _checkpoint(self, full: bool) -> None:
        """The flush-point policy at each step (see the module docstring). As with per-rollout
        streams, where every rollout joins a point at its next chunk: the rollouts that are
        full start the point and are cut at once; the others join at the next step (with it),
        and all go in one submission, at that step or ``gather_s`` later if the engine is
        slower. A point the clock (or another stream) started is joined by all at once."""
        commits = self.checkpointer
        point = self._point

        def joins(fill: int, track: Track) -> bool:
            return fill > 0 and track.point != point

        if self._joining:
            self._joining = False
            self._cut(joins)
            self._submit()
        elif full:
            commits.start_flush_point()
            point = self._point = commits.flush_points
            tokens = commits.cadence.tokens
            self._cut(lambda fill, track: fill >= tokens)
            self._joining = True
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(commits.gather_s, self._submit)
        elif commits.flush_point() != point:
            point = self._point = commits.flush_points
            self._cut(joins)
            self._submit()

    def _cut(self, joins: Callable[[int, Track], bool]) -> None:
        """Checkpoint chains for the open streams not saving that ``joins``, pending until
        ``_submit``; each such stream is saving from here on."""
        rows, fills = self._rows, self._rows.fill
        loop = asyncio.get_running_loop()
        for track in self._tracks.values():
            if track.saving is not None or not joins(int(fills[track.row]), track):
                continue
            joined = self._unsaved(track)
            if joined is None:
                continue
            event = commands.checkpoint(track.state, self.to_tokens(joined))
            track.point = self._point
            self._pending.append((track, (track.state, [event])))
            track.saving = loop.create_future()
            rows.saving[track.row] = True

    def _submit(self) -> None:
        """Hand the pending chains to the group commit, in one call."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        pending, self._pending = self._pending, []
        if not pending:
            return
        futures = self.checkpointer.submit([chain for _, chain in pending])
        for (track, _), future in zip(pending, futures, strict=True):
            future.add_done_callback(partial(self._saved, track))

    def _saved(self, track: Track, future: asyncio.Future[RolloutState]) -> None:
        saving = track.saving
        assert saving is not None
        if future.cancelled():
            saving.cancel()
            return
        error = future.exception()
        if error is not None:
            # Fenced out (AppendRefused) or Redis gone: the stream ends with it; the runner
            # aborts the engine request and raises it (as a failed checkpoint did before).
            saving.set_exception(error)
            saving.exception()  # raised from ``settle`` if the stream ended; else unused
            self._end(track, End(error=error))
            return
        track.state = future.result()
        track.saving = None
        saving.set_result(track.state)
        if not track.released:
            self._rows.saving[track.row] = False
        if self.on_saved is not None:
            self.on_saved()

    def _end(self, track: Track, end: End | None) -> None:
        """The stream takes no more tokens; its end is ``end`` (None: nobody waits for it)."""
        if self._tracks.get(track.request_id) is track:
            del self._tracks[track.request_id]
        if not track.ended.done():
            if end is None:
                track.ended.cancel()
            elif end.error is not None:
                track.ended.set_exception(end.error)
            else:
                track.ended.set_result(end)


def _copyable(exc: Exception) -> bool:
    """One exception instance raised in many tasks grows one traceback: copy engine errors."""
    return isinstance(exc, EngineError)
