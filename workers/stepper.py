"""One loop for all of a worker's engine streams: each engine step, whole, into per-rollout
buffers, and the due rollouts' checkpoints handed to the group commit together.

With ``Engine.generate`` every token of every request costs an async-iterator step, a
``Chunk``, a flush-point check and a list append in the rollout's own task: at vLLM's cadence
(one token per request per engine step, hundreds of requests) that was most of the worker's
CPU (profile in bench/bench_overhead.py's docstring). A ``StepEngine`` hands over one step for
all its requests at once; here it costs a dict lookup per request and a few numpy scatters
into preallocated arrays (one row per rollout, grown by doubling, drained at each
checkpoint), and the rollout's task sleeps until its stream ends.

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
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np

from statemachine import Event, RolloutState, commands
from statemachine.commands import NewTokens
from workers.checkpoint import Checkpointer
from workers.engines.base import End, EngineRequest, Joined, Step, StepEngine
from workers.engines.errors import EngineError, RequestAborted

log = logging.getLogger("rollouts.stepper")

_ROWS = 16  # rows to start with (grown by doubling)
_TOKENS = 32  # unsaved tokens per row to start with: 2x the default cadence


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


class _Rows:
    """Unsaved tokens, one row per track: ids, logprobs, versions and routes side by side."""

    def __init__(self) -> None:
        self.fill = np.zeros(_ROWS, dtype=np.int64)
        self.saving = np.zeros(_ROWS, dtype=bool)  # the row's checkpoint is in flight
        self.left = np.zeros(_ROWS, dtype=np.int64)  # tokens to go (rows told nearly_free)
        self.tokens = np.zeros((_ROWS, _TOKENS), dtype=np.int32)
        self.logprobs = np.zeros((_ROWS, _TOKENS), dtype=np.float32)
        self.versions = np.zeros((_ROWS, _TOKENS), dtype=np.int64)
        self.routes: np.ndarray | None = None  # [rows, tokens, layers, top_k], on first use
        # Top-k logprobs (``logprobs=k``): how many each row's request asked for, and the
        # arrays [rows, tokens, width], made on first use (never, for rollouts that ask none).
        self.k = np.zeros(_ROWS, dtype=np.int64)
        self.top_ids: np.ndarray | None = None
        self.top_lps: np.ndarray | None = None
        self.free = list(range(_ROWS - 1, -1, -1))

    def acquire(self, k: int = 0) -> int:
        """A free row, for a request that asked for ``k`` top logprobs per token."""
        if not self.free:
            n = len(self.fill)
            self._resize(2 * n, self.tokens.shape[1])
            self.free = list(range(2 * n - 1, n - 1, -1))
        row = self.free.pop()
        self.k[row] = k
        return row

    def release(self, row: int) -> None:
        self.fill[row] = 0
        self.saving[row] = False
        self.k[row] = 0
        self.free.append(row)

    def put_ones(self, rows: np.ndarray, step: Step, picks: np.ndarray | None) -> np.ndarray:
        """One token for each of ``rows`` (``picks``: which of the step's tokens; None: all);
        returns the rows' new fill."""
        pos: np.ndarray = self.fill[rows]
        if len(pos) and int(pos.max()) >= self.tokens.shape[1]:
            self._resize(len(self.fill), 2 * self.tokens.shape[1])

        def pick(a: np.ndarray) -> np.ndarray:
            return a if picks is None else a[picks]

        self.tokens[rows, pos] = pick(step.token_ids)
        self.logprobs[rows, pos] = pick(step.logprobs)
        self.versions[rows, pos] = step.weight_version
        if step.routed_experts is not None:
            self._routes_like(step.routed_experts)[rows, pos] = pick(step.routed_experts)
        if step.top_token_ids is not None and step.top_logprobs is not None:
            top_ids, top_lps = self._tops(step.top_token_ids.shape[1])
            width = step.top_token_ids.shape[1]
            top_ids[rows, pos, :width] = pick(step.top_token_ids)
            top_lps[rows, pos, :width] = pick(step.top_logprobs)
        pos += 1
        self.fill[rows] = pos
        return pos

    def put(self, row: int, step: Step, lo: int, hi: int) -> int:
        """Tokens ``lo:hi`` of the step for ``row``; returns its new fill."""
        at = int(self.fill[row])
        end = at + hi - lo
        if end > self.tokens.shape[1]:
            self._resize(len(self.fill), max(2 * self.tokens.shape[1], end))
        self.tokens[row, at:end] = step.token_ids[lo:hi]
        self.logprobs[row, at:end] = step.logprobs[lo:hi]
        self.versions[row, at:end] = step.weight_version
        if step.routed_experts is not None:
            self._routes_like(step.routed_experts)[row, at:end] = step.routed_experts[lo:hi]
        if step.top_token_ids is not None and step.top_logprobs is not None:
            width = step.top_token_ids.shape[1]
            top_ids, top_lps = self._tops(width)
            top_ids[row, at:end, :width] = step.top_token_ids[lo:hi]
            top_lps[row, at:end, :width] = step.top_logprobs[lo:hi]
        self.fill[row] = end
        return end

    def take(self, row: int) -> Joined | None:
        """The row's unsaved tokens (copies), and the row emptied; None if it has none."""
        n = int(self.fill[row])
        if n == 0:
            return None
        self.fill[row] = 0
        k = int(self.k[row])
        # A row that asked for top-k gets its first k columns (each row most likely first); if
        # the engine gave none, none: the store then refuses the chunk (TopLogprobsMismatch).
        tops = k and self.top_ids is not None and self.top_lps is not None
        return Joined(
            token_ids=self.tokens[row, :n].copy(),
            logprobs=self.logprobs[row, :n].copy(),
            weight_versions=self.versions[row, :n].copy(),
            routed_experts=None if self.routes is None else self.routes[row, :n].copy(),
            top_token_ids=self.top_ids[row, :n, :k].copy() if tops else None,  # type: ignore[index]
            top_logprobs=self.top_lps[row, :n, :k].copy() if tops else None,  # type: ignore[index]
        )

    def _tops(self, width: int) -> tuple[np.ndarray, np.ndarray]:
        """The top-k arrays, at least ``width`` wide (what they held is kept)."""
        if self.top_ids is None or self.top_lps is None or self.top_ids.shape[2] < width:
            rows, tokens = self.tokens.shape
            ids = np.zeros((rows, tokens, width), dtype=np.int32)
            lps = np.zeros((rows, tokens, width), dtype=np.float32)
            if self.top_ids is not None and self.top_lps is not None:
                old = self.top_ids.shape[2]
                ids[:, :, :old], lps[:, :, :old] = self.top_ids, self.top_lps
            self.top_ids, self.top_lps = ids, lps
        return self.top_ids, self.top_lps

    def _routes_like(self, routes: np.ndarray) -> np.ndarray:
        if self.routes is None or self.routes.shape[2:] != routes.shape[1:]:
            rows, tokens = self.tokens.shape
            self.routes = np.empty((rows, tokens, *routes.shape[1:]), dtype=routes.dtype)
        return self.routes

    def _resize(self, rows: int, tokens: int) -> None:
        def grown(a: np.ndarray) -> np.ndarray:
            if a.ndim == 1:  # fill, saving, left: read for every row, so zeroed
                b = np.zeros(rows, dtype=a.dtype)
                b[: len(a)] = a
                return b
            # Token data: a row is read only up to its fill, so the rest need not be zeroed
            # (at 256 rows with 48x8 routes, zeroing was ~25 MB per doubling, measured as
            # ~0.5 us per token of a fresh worker's first 131k tokens).
            b = np.empty((rows, tokens, *a.shape[2:]), dtype=a.dtype)
            b[: a.shape[0], : a.shape[1]] = a
            return b

        self.fill, self.saving, self.left = grown(self.fill), grown(self.saving), grown(self.left)
        self.k = grown(self.k)
        if self.top_ids is not None and self.top_lps is not None:
            self.top_ids, self.top_lps = grown(self.top_ids), grown(self.top_lps)
        self.tokens, self.logprobs = grown(self.tokens), grown(self.logprobs)
        self.versions = grown(self.versions)
        if self.routes is not None:
            self.routes = grown(self.routes)


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
        self._rows = _Rows()
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
            return state, self._rows.take(track.row)
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
        for rid, end in step.ends.items():
            track = tracks.get(rid)
            if track is not None:
                self._end(track, end)
        self._checkpoint(full)

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
            joined = rows.take(track.row)
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
