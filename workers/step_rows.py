"""The stepper's unsaved tokens (``workers.stepper``): one row per open stream, its token ids,
logprobs, weight versions, routes and top-k side by side in preallocated arrays, grown by
doubling and drained at each checkpoint, so that a whole engine step lands in a few numpy
scatters instead of a ``Chunk`` per token per request."""

from __future__ import annotations

import numpy as np

from workers.engines.base import Joined, Step

_ROWS = 16  # rows to start with (grown by doubling)
_TOKENS = 32  # unsaved tokens per row to start with: 2x the default cadence


class Rows:
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
