"""workers.ops.timeline_plot and `rollouts show ID --plot FILE`: what is drawn is checked as data
(the rows of bars and marks handed to matplotlib), the file by its signature, never by pixels.

The scenario is the one the picture exists for: attempt 1 on worker a (weights v1) saves some
tokens, then a is killed; its lease runs out, the reaper records aborted(worker_lost), and
attempt 2 resumes on worker b, which by then serves weights v2. Its events are built with
chosen times (tests/factories.py) so every bar's ends are known exactly, and appended to a real
redis-server through the event store, from which `rollouts show` reads them back.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from statemachine import AbortReason, Event, RolloutState, apply
from store.client import RolloutClient
from store.redis_server import RedisServer
from store.timeline import Timeline, build
from tests import factories as f
from workers.cli import main
from workers.ops import timeline_plot
from workers.ops.timeline_plot import Mark, Row, Segment, plot_timelines, rows

PNG = b"\x89PNG\r\n\x1a\n"
T0 = 1_700_000_000.0


class Log:
    """A rollout's events with the times they happened, each checked by the domain."""

    def __init__(self, rid: str, at: float = T0, max_tokens: int = 64) -> None:
        self.events: list[Event] = []
        self.state: RolloutState | None = None
        self.add(f.submitted(rid, max_tokens=max_tokens), at)

    def add(self, event: Event, at: float) -> None:
        event = replace(event, at=at)
        self.state = apply(self.state, event)
        self.events.append(event)

    def __call__(self, make: Callable[..., Event], at: float, *args: Any, **kw: Any) -> None:
        assert self.state is not None
        self.add(make(self.state, *args, **kw), at)


def killed_and_resumed(rid: str = "step1.0.0") -> Log:
    log = Log(rid)
    log(f.started, T0 + 1.0, "a", 1)
    log(f.tokens, T0 + 1.5, n=8, version=1)
    log(f.tokens, T0 + 2.0, n=8, version=1)
    # a is killed at ~T0 + 2.1; its lease runs out and a reaper aborts the attempt at T0 + 7.
    log(f.aborted, T0 + 7.0, AbortReason.WORKER_LOST)
    log(f.resumed, T0 + 7.5, "b", 2)
    log(f.tokens, T0 + 8.0, n=8, version=2)
    log(f.tokens, T0 + 8.5, n=8, version=2)
    log(f.finished, T0 + 8.5)
    return log


EXPECTED = Row(
    rollout_id="step1.0.0", status="done", submitted_at=T0,
    segments=(
        Segment(attempt=1, worker_id="a", weight_version=1, start=T0 + 1.0, end=T0 + 7.0,
                saved_until=T0 + 2.0, tokens=16),
        Segment(attempt=2, worker_id="b", weight_version=2, start=T0 + 7.5, end=T0 + 8.5,
                saved_until=T0 + 8.5, tokens=16),
    ),
    marks=(
        Mark(kind="aborted", at=T0 + 7.0, reason="worker_lost"),
        Mark(kind="resumed", at=T0 + 7.5),
        Mark(kind="finished", at=T0 + 8.5, reason="length"),
    ),
)  # fmt: skip


def test_an_attempt_killed_and_resumed_on_another_worker_across_a_weight_version() -> None:
    [row] = rows([build(killed_and_resumed().events)])
    # a's bar runs to the abort; only its first second was saved (drawn solid), the rest is
    # the time its lease took to run out.
    assert row == EXPECTED


def test_a_weight_swap_under_a_live_attempt_splits_its_bar_and_live_ends_stay_open() -> None:
    keep = Log("keep")
    keep(f.started, T0 + 1.0, "a", 1)
    keep(f.tokens, T0 + 2.0, n=4, version=1)
    keep.add(_mixed(keep, [1, 2, 2]), T0 + 3.0)  # `keep` mode: v2 loaded mid-attempt
    keep(f.tokens, T0 + 4.0, n=2, version=2)
    waiting = Log("waiting")
    waiting(f.started, T0 + 1.0, "a", 1)
    waiting(f.aborted, T0 + 2.0, AbortReason.SHUTDOWN)  # no checkpoint: nothing saved
    first_v2, live = rows([build(keep.events), build(waiting.events)])
    assert first_v2.segments == (
        Segment(attempt=1, worker_id="a", weight_version=1, start=T0 + 1.0, end=T0 + 3.0,
                saved_until=T0 + 3.0, tokens=5),
        Segment(attempt=1, worker_id="a", weight_version=2, start=T0 + 3.0, end=None,
                saved_until=T0 + 4.0, tokens=4),
    )  # fmt: skip
    assert (first_v2.status, first_v2.marks) == ("generating", ())
    assert live.segments == (
        Segment(attempt=1, worker_id="a", weight_version=1, start=T0 + 1.0, end=T0 + 2.0,
                saved_until=None, tokens=0),
    )  # fmt: skip
    assert live.marks == (Mark(kind="aborted", at=T0 + 2.0, reason="shutdown"),)
    assert live.status == "aborted"


def _mixed(log: Log, versions: list[int]) -> Event:
    assert log.state is not None
    ev = f.tokens(log.state, n=len(versions))
    return replace(ev, weight_versions=np.array(versions, dtype=np.int64))


def test_a_batch_draws_one_row_per_rollout(tmp_path: Path) -> None:
    timelines = [build(killed_and_resumed(f"step1.{i}.0").events) for i in range(64)]
    out = tmp_path / "batch.svg"
    drawn = plot_timelines(timelines, out, title="64 rollouts")
    assert [r.rollout_id for r in drawn] == [f"step1.{i}.0" for i in range(64)]
    assert drawn[5] == replace(EXPECTED, rollout_id="step1.5.0")
    assert out.read_bytes().startswith(b"<?xml") and b"64 rollouts" in out.read_bytes()
    assert [p.name for p in tmp_path.iterdir()] == ["batch.svg"]  # no temporary file left


@pytest.mark.redis_server
async def test_show_plot_writes_a_png_of_the_rows_of_the_rollout(
    server: RedisServer, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    client = RolloutClient(server.url)
    state = None
    for event in killed_and_resumed().events:
        state = await client.store.append(state, event)
    await client.aclose()
    given: list[tuple[list[Timeline], list[Row]]] = []

    def spy(timelines: list[Timeline], path: str, **kw: Any) -> list[Row]:
        drawn = plot_timelines(timelines, path, **kw)
        given.append((list(timelines), drawn))
        return drawn

    monkeypatch.setattr(timeline_plot, "plot_timelines", spy)
    png = tmp_path / "f.png"
    code, out, err = await _cli(capsys, "show", "step1.0.0", "--redis", server.url, "--plot",
                                str(png))  # fmt: skip
    assert code == 0, err
    assert out.splitlines()[-1] == f"timeline drawn to {png}"
    assert out.splitlines()[0] == "rollout step1.0.0: done, 32 tokens (v1: 16, v2: 16), 2 attempts"
    data = png.read_bytes()
    assert data.startswith(PNG) and len(data) > 1000
    [(timelines, drawn)] = given
    assert [t.rollout_id for t in timelines] == ["step1.0.0"]
    assert drawn == [EXPECTED]  # the times survived the round trip through Redis exactly

    # --json keeps stdout one JSON document.
    code, out, _ = await _cli(capsys, "show", "step1.0.0", "--json", "--redis", server.url,
                              "--plot", str(tmp_path / "g.png"))  # fmt: skip
    assert code == 0 and out.startswith("{") and out.rstrip().endswith("}")
    assert (tmp_path / "g.png").read_bytes().startswith(PNG)


# Port 1: nothing listens there. These fail before Redis is asked (else: ~15 s of retries).
NOWHERE = "redis://127.0.0.1:1/0"


async def test_show_plot_refuses_a_file_it_cannot_write_before_reading_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for target, why in [
        (tmp_path / "t.jpg", f"must end in .png, .svg, .pdf, got '{tmp_path / 't.jpg'}'"),
        (tmp_path / "no" / "t.png", f"no directory '{tmp_path / 'no'}' to write 't.png' into"),
    ]:
        code, out, err = await _cli(capsys, "show", "x", "--redis", NOWHERE, "--plot",
                                    str(target))  # fmt: skip
        assert (code, out) == (2, "")
        assert err.startswith("rollouts show: error: ") and err.count("\n") == 1
        assert why in err
    assert list(tmp_path.iterdir()) == []


async def test_show_plot_without_matplotlib_says_how_to_install_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ["matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"]:
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError
    code, out, err = await _cli(capsys, "show", "x", "--redis", NOWHERE, "--plot",
                                str(tmp_path / "t.png"))  # fmt: skip
    assert (code, out) == (2, "")
    assert err == (
        "rollouts show: error: drawing a timeline needs matplotlib: pip install "
        "'matplotlib>=3.8,<4' (the cpu and dev extras include it)\n"
    )
    assert list(tmp_path.iterdir()) == []


async def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = await asyncio.to_thread(main, list(argv))
    out, err = capsys.readouterr()
    return code, out, err
