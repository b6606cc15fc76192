"""The demo's live progress display (rich) and its final report."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from statemachine import Status
from store.client import RolloutClient
from store.stats import Stats
from workers.demo.loop import Progress

REFRESH_S = 0.5


class Live:
    """Polls ``client.stats()`` and redraws a table of rollouts by state, tokens/s, aborts and
    resumes (rollouts in those states now), weight version and worker kills."""

    def __init__(self, client: RolloutClient, progress: Progress) -> None:
        self.client = client
        self.progress = progress
        self._last: tuple[float, int] | None = None
        self.rate = 0.0
        self.aborted_seen = 0

    def table(self, stats: Stats) -> Any:
        from rich.table import Table  # noqa: PLC0415  (only when drawing)

        now = time.monotonic()
        if self._last is not None and now > self._last[0]:
            self.rate = (stats.tokens - self._last[1]) / (now - self._last[0])
        self._last = (now, stats.tokens)
        p = self.progress
        t = Table(title=f"rollouts demo: step {p.step}/{p.steps}", show_header=False)
        t.add_column(style="bold")
        t.add_column()
        states = "  ".join(f"{s.value} {stats.by_state[s]}" for s in Status)
        t.add_row("rollouts", f"{p.submitted} submitted, {p.consumed} consumed and acked")
        t.add_row("by state", states)
        t.add_row("tokens", f"{stats.tokens} ({self.rate:,.0f} tokens/s)")
        t.add_row(
            "aborted / resumed now",
            f"{stats.by_state[Status.ABORTED]} / {stats.by_state[Status.RESUMED]}",
        )
        t.add_row("weights", f"v{p.weight_version} ({p.weight_updates} updates published)")
        workers = ", ".join(f"{w.worker_id} ({w.in_flight})" for w in stats.workers)
        t.add_row("workers", f"{workers or '-'}; {p.worker_kills} killed")
        for n in p.notes[-4:]:
            t.add_row("", n)
        return t


@contextlib.asynccontextmanager
async def live_display(client: RolloutClient, progress: Progress) -> AsyncIterator[None]:
    from rich.live import Live as RichLive  # noqa: PLC0415

    view = Live(client, progress)
    with RichLive(view.table(await client.stats()), refresh_per_second=4) as live:

        async def redraw() -> None:
            while True:
                await asyncio.sleep(REFRESH_S)
                # A stats read failing once (Redis busy) only skips one frame.
                with contextlib.suppress(Exception):
                    live.update(view.table(await client.stats()))

        task = asyncio.create_task(redraw())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def report_text(report: dict[str, Any], mismatches: list[str]) -> str:
    r = report
    reasons = ", ".join(f"{n} {why}" for why, n in sorted(r["aborts_by_reason"].items()))
    lines = [
        "",
        f"rollouts: {r['rollouts_submitted']} submitted, {r['rollouts_done']} done, "
        f"{r['tokens']} tokens kept ({r['tokens_appended']} appended in all, "
        f"{r['tokens_regenerated']} of them again after a kill)",
        f"faults: {r['worker_kills']} worker SIGKILLed mid-generation, "
        f"{r['weight_updates']} weight updates while generating",
        f"aborts: {r['aborts']} ({reasons}), resumes: {r['resumes']}; "
        f"{r['rollouts_interrupted']} rollouts were interrupted, "
        f"{r['rollouts_multi_version']} span two or more weight versions",
        f"check: {r['segments_checked']} weight segments of {r['rollouts_done']} greedy rollouts "
        f"against an uninterrupted run: {r['mismatches']} mismatches",
        f"API: {r['api_url']} (healthz ok); picture: {r['plot']}; wall time {r['wall_s']:.1f} s",
    ]
    lines += [f"MISMATCH {m}" for m in mismatches]
    if r["mismatches"] == 0:
        lines.append("nothing lost, nothing generated wrong: every token equals the "
                     "uninterrupted run")  # fmt: skip
    return "\n".join(lines)
