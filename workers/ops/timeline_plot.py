"""Rollout timelines as a picture: one row per rollout over time.

Each attempt is a bar from its start (or resume) to its end, colored by the weight version that
sampled its tokens (a bar changes color where `keep` mode swapped weights under it) and labelled
with the worker that ran it. Marks show where an attempt was aborted (one marker per reason),
where the next one resumed, and how the rollout ended; a thin line is time spent waiting for a
worker. The part of a bar after its last checkpoint is drawn pale: nothing of it was saved, so
for an attempt whose worker was killed it is the time until its lease ran out.

``rows`` turns ``store.timeline`` timelines into exactly what is drawn (pure, so tests check the
data, not pixels); ``plot_timelines`` draws them. It works the same for one rollout
(``rollouts show ID --plot FILE``) and for a demo's whole batch. matplotlib is imported only to
draw (``rollouts show`` without ``--plot`` must not need it), and through its Agg canvas
directly: no pyplot, no display, no process-wide backend switch.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from statemachine import AbortReason
from store.timeline import Entry, Timeline

INSTALL_HINT = (
    "drawing a timeline needs matplotlib: pip install 'matplotlib>=3.8,<4' "
    "(the cpu and dev extras include it)"
)
FORMATS = (".png", ".svg", ".pdf")
ENDINGS = ("aborted", "finished", "failed", "cancelled")  # entry kinds that end an attempt

# One marker per abort reason, so a picture of many rows says why without any text.
ABORT_MARKERS = {
    AbortReason.WORKER_LOST.value: "X",
    AbortReason.WEIGHT_UPDATE.value: "v",
    AbortReason.SHUTDOWN.value: "s",
    AbortReason.ENGINE_DEAD.value: "*",
    AbortReason.ENGINE_ERROR.value: "D",
    AbortReason.CANCELLED.value: "P",
    AbortReason.PAUSED.value: "^",
}
END_STYLES = {  # marker, color
    "finished": ("|", "black"),
    "failed": ("X", "#7f0000"),
    "cancelled": ("_", "#555555"),
}
ABORT_COLOR, RESUME_COLOR, WAIT_COLOR = "#d62728", "#2ca02c", "#9a9a9a"
UNSAVED_ALPHA = 0.3
FEW_ROWS = 8  # up to this many rows, bars and marks also carry text (tokens, reasons)


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed; the message says how to install it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Segment:
    """A stretch of one attempt on one worker with one weight version: one bar."""

    attempt: int
    worker_id: str
    weight_version: int
    start: float
    end: float | None  # None: still running when the log was read
    # The last checkpoint within the stretch (None: none); after it nothing was saved.
    saved_until: float | None
    tokens: int  # tokens of this weight version the attempt saved


@dataclass(frozen=True, slots=True, kw_only=True)
class Mark:
    kind: str  # resumed | aborted | finished | failed | cancelled
    at: float
    reason: str = ""  # abort reason, finish reason or failure class


@dataclass(frozen=True, slots=True, kw_only=True)
class Row:
    rollout_id: str
    status: str
    submitted_at: float
    segments: tuple[Segment, ...]
    marks: tuple[Mark, ...]


# -- what is drawn (pure) ---------------------------------------------------------------------
def rows(timelines: Sequence[Timeline]) -> list[Row]:
    return [_row(t) for t in timelines]


def _row(t: Timeline) -> Row:
    segments: list[Segment] = []
    marks: list[Mark] = []
    for e in t.entries:
        if e.kind in ("started", "resumed"):
            _close(segments, e.at)  # the domain aborts a live attempt first; belt and braces
            segments.append(Segment(
                attempt=e.attempt or 0, worker_id=e.worker_id or "?",
                weight_version=e.weight_version or 0, start=e.at, end=None, saved_until=None,
                tokens=0,
            ))  # fmt: skip
            if e.kind == "resumed":
                marks.append(Mark(kind="resumed", at=e.at))
        elif e.kind == "checkpoints":
            _saved(segments, e)
        elif e.kind in ENDINGS:
            _close(segments, e.at)
            marks.append(Mark(kind=e.kind, at=e.at, reason=e.reason))
        elif e.kind == "tool_requested":
            _close(segments, e.at)  # an episode's turn ends its attempt: the tool runs unbarred
    return Row(
        rollout_id=t.rollout_id, status=t.state.status.value, submitted_at=t.entries[0].at,
        segments=tuple(segments), marks=tuple(marks),
    )  # fmt: skip


def _close(segments: list[Segment], at: float) -> None:
    if segments and segments[-1].end is None:
        segments[-1] = replace(segments[-1], end=at)


def _saved(segments: list[Segment], e: Entry) -> None:
    """An attempt's checkpoints: its tokens, per weight version, into the open bar; a new
    version starts a new bar where its first token was saved."""
    if not segments or segments[-1].end is not None or segments[-1].attempt != e.attempt:
        return  # tokens of an attempt that has no open bar: the domain never writes that
    for version, at in e.version_from.items():
        cur = segments[-1]
        if version != cur.weight_version:
            segments[-1] = replace(cur, end=at, saved_until=at)
            segments.append(replace(cur, weight_version=version, start=at, tokens=0))
        segments[-1] = replace(segments[-1], tokens=segments[-1].tokens + e.by_version[version])
    segments[-1] = replace(segments[-1], saved_until=e.until)


# -- drawing ----------------------------------------------------------------------------------
def check(path: str | Path) -> str | None:
    """Why ``plot_timelines`` could not write ``path`` (one line), or None. Checked before
    anything is read, so a bad ``--plot`` costs nothing and writes nothing."""
    problem = _path_problem(Path(path))
    if problem is not None:
        return problem
    try:
        _matplotlib()
    except PlotUnavailable as exc:
        return str(exc)
    return None


def _path_problem(p: Path) -> str | None:
    if p.suffix.lower() not in FORMATS:
        return f"the picture's file name must end in {', '.join(FORMATS)}, got {str(p)!r}"
    if not p.parent.is_dir():
        return f"no directory {str(p.parent)!r} to write {p.name!r} into"
    return None


def plot_timelines(
    timelines: Sequence[Timeline],
    path: str | Path,
    *,
    now: float | None = None,
    title: str | None = None,
) -> list[Row]:
    """Draw one row per timeline into ``path`` (.png, .svg or .pdf, replaced atomically) and
    return the rows drawn. A bar still running ends at ``now`` (default: the latest time any
    timeline records). Raises ``ValueError`` for a path ``check`` refuses or no timelines,
    ``PlotUnavailable`` without matplotlib."""
    figure_cls, canvas_cls = _matplotlib()
    problem = _path_problem(Path(path))
    if problem is not None:
        raise ValueError(problem)
    if not timelines:
        raise ValueError("no timelines to draw")
    drawn = rows(timelines)
    origin = min(r.submitted_at for r in drawn)
    end = now if now is not None else max(_last(t.entries) for t in timelines)
    fig = figure_cls(figsize=(11, 1.6 + 0.26 * len(drawn)), layout="constrained")
    canvas_cls(fig)
    ax = fig.add_subplot()
    colors = _version_colors(drawn)
    span = max(end - origin, 1e-3)
    shapes = _Shapes(origin, end, span, few=len(drawn) <= FEW_ROWS)
    for y, row in enumerate(drawn):
        shapes.row(y, row, colors)
    shapes.paint(ax)
    ax.set_ylim(len(drawn) - 0.5, -0.5)  # first row on top
    ax.set_xlim(-0.01 * span, span * 1.02)
    ax.set_yticks(range(len(drawn)), [r.rollout_id for r in drawn],
                  fontsize=8 if len(drawn) <= 32 else 6)  # fmt: skip
    ax.set_xlabel("seconds since the first submit")
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(title or _title(drawn, colors), fontsize=10)
    fig.legend(handles=_legend(drawn, colors), loc="outside right upper", fontsize=8)
    _save(fig, Path(path))
    return drawn


def _matplotlib() -> tuple[Any, Any]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415
        from matplotlib.figure import Figure  # noqa: PLC0415
    except ImportError:
        raise PlotUnavailable(INSTALL_HINT) from None
    return Figure, FigureCanvasAgg


def _last(entries: Sequence[Entry]) -> float:
    return max(e.until if e.until is not None else e.at for e in entries)


def _version_colors(drawn: Sequence[Row]) -> dict[int, Any]:
    from matplotlib import colormaps  # noqa: PLC0415

    versions = sorted({s.weight_version for r in drawn for s in r.segments})
    cmap = colormaps["viridis"]
    # Ordered colors for ordered versions; the pale yellow end is left out (white text).
    return {v: cmap(0.85 * i / max(1, len(versions) - 1)) for i, v in enumerate(versions)}


class _Shapes:
    """Every bar, line, label and marker of the picture, gathered so that each kind is drawn
    with one matplotlib call: an artist per bar made 64 rows take seconds, one per kind
    takes a fraction of that."""

    def __init__(self, origin: float, end: float, span: float, *, few: bool) -> None:
        self.origin, self.end, self.span, self.few = origin, end, span, few
        self.bars: list[tuple[int, float, float, Any]] = []  # y, left, width, rgba
        self.waits: list[tuple[int, float, float]] = []  # y, from, to
        self.labels: list[tuple[float, int, str, str]] = []  # x, y, text, ink
        self.marks: dict[tuple[str, str], list[tuple[float, int]]] = {}  # (marker, color)
        self.notes: list[tuple[float, int, str]] = []  # x, y, abort reason

    def row(self, y: int, row: Row, colors: dict[int, Any]) -> None:
        # Waiting for a worker: from the submit, and between one attempt and the next.
        last = row.submitted_at
        for s in row.segments:
            self._wait(y, last, s.start)
            last = s.end if s.end is not None else self.end
        ended = [m.at for m in row.marks if m.kind in END_STYLES]
        self._wait(y, last, ended[0] if ended else self.end)
        for s in row.segments:
            self._segment(y, s, colors[s.weight_version])
        for m in row.marks:
            self._mark(y, m)

    def _wait(self, y: int, a: float, b: float) -> None:
        if b > a:
            self.waits.append((y, a - self.origin, b - self.origin))

    def _segment(self, y: int, s: Segment, color: Any) -> None:
        stop = s.end if s.end is not None else self.end
        saved = min(stop, s.saved_until) if s.saved_until is not None else s.start
        pale = (*color[:3], UNSAVED_ALPHA)
        for a, b, rgba in [(s.start, saved, color), (saved, stop, pale)]:
            if b > a:
                self.bars.append((y, a - self.origin, b - a, rgba))
        if (stop - s.start) / self.span >= 0.06:  # room for a label inside the bar
            middle = (s.start + stop) / 2
            r, g, b = color[:3]
            dark = 0.299 * r + 0.587 * g + 0.114 * b < 0.5  # luminance
            ink = "white" if dark and middle < saved else "black"  # the pale part is light
            text = f"{s.worker_id} ({s.tokens} tok)" if self.few else s.worker_id
            self.labels.append((middle - self.origin, y, text, ink))

    def _mark(self, y: int, m: Mark) -> None:
        if m.kind == "aborted":
            style = (ABORT_MARKERS.get(m.reason, "o"), ABORT_COLOR)
            if self.few:
                self.notes.append((m.at - self.origin, y, m.reason))
        elif m.kind == "resumed":
            style = (">", RESUME_COLOR)
        else:
            style = END_STYLES[m.kind]
        self.marks.setdefault(style, []).append((m.at - self.origin, y))

    def paint(self, ax: Any) -> None:
        if self.waits:
            ys, xa, xb = zip(*self.waits, strict=True)
            ax.hlines(ys, xa, xb, colors=WAIT_COLOR, linewidth=1, zorder=1)
        if self.bars:
            from matplotlib.collections import PolyCollection  # noqa: PLC0415

            h = 0.3  # half a bar's height
            boxes = [[(x, y - h), (x + w, y - h), (x + w, y + h), (x, y + h)]
                     for y, x, w, _ in self.bars]  # fmt: skip
            # One collection, limits set by the caller: a patch per bar is ~20x slower.
            ax.add_collection(PolyCollection(boxes, facecolors=[b[3] for b in self.bars],
                                             linewidths=0, zorder=2), autolim=False)  # fmt: skip
        size = 8 if self.few else 5
        for x, y, text, ink in self.labels:
            ax.text(x, y, text, ha="center", va="center", fontsize=size, color=ink,
                    clip_on=True, zorder=3)  # fmt: skip
        for (marker, color), points in self.marks.items():
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, marker=marker, color=color, markersize=size, linestyle="none",
                    zorder=4)  # fmt: skip
        for x, y, reason in self.notes:
            ax.annotate(reason, (x, y), xytext=(0, 9), textcoords="offset points",
                        ha="center", fontsize=7, color=ABORT_COLOR)  # fmt: skip


def _title(drawn: Sequence[Row], colors: dict[int, Any]) -> str:
    aborts = sum(m.kind == "aborted" for r in drawn for m in r.marks)
    resumes = sum(m.kind == "resumed" for r in drawn for m in r.marks)
    versions = ", ".join(f"v{v}" for v in colors)
    what = f"{len(drawn)} rollouts" if len(drawn) != 1 else f"rollout {drawn[0].rollout_id}"
    return f"{what}: {aborts} aborted, {resumes} resumed; weights {versions or 'none'}"


def _legend(drawn: Sequence[Row], colors: dict[int, Any]) -> list[Any]:
    from matplotlib.lines import Line2D  # noqa: PLC0415
    from matplotlib.patches import Patch  # noqa: PLC0415

    handles: list[Any] = [Patch(color=c, label=f"weights v{v}") for v, c in colors.items()]
    handles.append(
        Patch(color="grey", alpha=UNSAVED_ALPHA, label="not saved (after the last checkpoint)")
    )
    handles.append(Line2D([], [], color=WAIT_COLOR, label="waiting for a worker"))
    marks = {(m.kind, m.reason if m.kind == "aborted" else "") for r in drawn for m in r.marks}
    for reason in sorted(r for k, r in marks if k == "aborted"):
        handles.append(_marker(Line2D, ABORT_MARKERS.get(reason, "o"), ABORT_COLOR,
                               f"aborted: {reason}"))  # fmt: skip
    if ("resumed", "") in marks:
        handles.append(_marker(Line2D, ">", RESUME_COLOR, "resumed"))
    for kind, (marker, color) in END_STYLES.items():
        if (kind, "") in marks:
            handles.append(_marker(Line2D, marker, color, kind))
    return handles


def _marker(line_cls: Any, marker: str, color: str, label: str) -> Any:
    return line_cls([], [], marker=marker, color=color, linestyle="none", label=label)


def _save(fig: Any, path: Path) -> None:
    """Write through a temporary file in the same directory: a reader never sees half a
    picture, and a failed draw leaves any earlier picture in place."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fig.savefig(tmp, format=path.suffix.lower().lstrip("."), dpi=120)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
