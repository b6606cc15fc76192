"""``rollouts demo``: an RL loop's rollouts surviving a worker kill and weight updates, shown.

It starts a redis-server of its own in a temporary directory with AOF ``appendfsync always``
(unless given a Redis URL with ``--redis`` or ``--redis-url-file``; ``$ROLLOUTS_REDIS_URL`` is
ignored here, so the demo never writes into a deployment's Redis by accident), builds a tiny
random-weight Qwen3-MoE model (no download), starts the HTTP API and two CPU-engine workers,
and runs a small trainer loop through the trainer API (``demo_loop``): groups consumed in
completion order and acknowledged, new weights published while the next step generates, one
worker SIGKILLed mid-generation and replaced. A live display shows it (``demo_display``); at
the end every greedy rollout is checked against an uninterrupted run per weight segment
(``demo_reference``), a picture of the rollouts is drawn, and everything it started is
stopped and removed, on Ctrl-C too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from statemachine import Aborted, Event, Resumed, Status
from store import redis_options, timeline
from store.client import RolloutClient
from store.connection import URL_ENV, redact
from store.errors import InvalidRedisUrl
from store.redis_server import RedisServer, free_port
from store.results import RolloutResult
from workers import worker_cli
from workers.demo import display as demo_display
from workers.demo import loop as demo_loop
from workers.demo import reference as demo_reference

PLOT_ROWS = 64  # rows in the picture: every interrupted rollout first, then others
STOP_S = 10.0


def configure(parser: argparse.ArgumentParser) -> None:
    redis_options.add_arguments(parser, otherwise="start a redis-server of its own", use_env=False)
    parser.add_argument("--model", help="model directory (default: build the tiny MoE model)")
    for flag, default, what in (
        ("--steps", 4, "trainer steps; new weights are published between steps"),
        ("--prompts", 16, "prompts each step submits"),
        ("--samples", 4, "samples of each prompt (the group size)"),
        ("--max-tokens", 24, "tokens each rollout generates"),
    ):
        parser.add_argument(flag, type=int, default=default, help=f"{what} (default {default})")
    parser.add_argument(
        "--json", action="store_true", help="print only the report, as one JSON object (a switch)"
    )
    parser.add_argument(
        "--plot",
        default="rollouts-timeline.png",
        help="where to draw the rollouts' timelines (default rollouts-timeline.png)",
    )


def _cache_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "durable-rollouts"


def _model(path: str | None, say: Any) -> Path:
    if path:
        return Path(path)
    target = _cache_dir() / "tiny-qwen3-moe-seed0"
    if not (target / "config.json").exists():
        from workers.demo.tiny_model import make_tiny_model  # noqa: PLC0415  (torch: on demand)

        say(f"building the tiny MoE model in {target} (random weights, no download)")
        make_tiny_model(target, moe=True, seed=0)
    return target


class Processes:
    """The demo's child processes; ``stop_all`` ends each (SIGTERM, then SIGKILL)."""

    def __init__(self, url: str, model: Path, logs: Path) -> None:
        self.url, self.model, self.logs = url, model, logs
        self.workers: dict[str, subprocess.Popen[bytes]] = {}
        self.all: list[subprocess.Popen[bytes]] = []
        # The URL travels in the environment: on the command line `ps` would show its password.
        # Engine processes end with their worker, even a SIGKILLed one.
        self.env = {**os.environ, URL_ENV: url, "ROLLOUTS_DIE_WITH_PARENT": "1"}

    def _popen(self, cmd: list[str], log: str) -> subprocess.Popen[bytes]:
        # Each in a process group of its own: a worker's engine process goes with it, and a
        # Ctrl-C reaches the demo only, which then stops them in order.
        p = subprocess.Popen(
            cmd,
            stdout=(self.logs / log).open("wb"),
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,
        )
        self.all.append(p)
        return p

    def worker(self, name: str) -> None:
        cmd = worker_cli.command(None, self.model, name, "--checkpoint-tokens", "8", concurrency=4)
        self.workers[name] = self._popen(cmd, f"{name}.log")

    def api(self) -> str:
        port = free_port()
        cmd = [sys.executable, "-m", "workers.cli", "api", "--port", str(port)]
        p = self._popen(cmd, "api.log")
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{url}/healthz", timeout=2) as r:
                    if r.status == 200:
                        return url
            except OSError as exc:
                # Not listening yet; an API that exited will not come up.
                if p.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the API did not come up; see {self.logs / 'api.log'}"
                    ) from exc
            time.sleep(0.2)

    def kill(self, busy: set[str]) -> str:
        name = sorted(busy)[0]
        _signal_group(self.workers[name], signal.SIGKILL)  # the worker and its engine, at once
        self.workers[name].wait()
        self.worker(f"{name}-replacement")
        return name

    def stop_all(self) -> None:
        for p in self.all:
            if p.poll() is None:
                _signal_group(p, signal.SIGTERM)
        for p in self.all:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(STOP_S)
            # Whatever of its group is left (an engine process still loading, a worker that
            # did not stop in time) ends now.
            _signal_group(p, signal.SIGKILL)
            p.wait()


def _signal_group(p: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        # Gone already: the whole group has exited.
        os.killpg(p.pid, sig)


async def _demo(
    args: argparse.Namespace, url: str, model: Path, tmp: Path, say: Any
) -> dict[str, Any]:
    from transformers import AutoTokenizer  # noqa: PLC0415

    t0 = time.monotonic()
    logs = tmp / "logs"
    logs.mkdir()
    procs = Processes(url, model, logs)
    # Any: transformers' tokenizers declare a wider decode() than the client's Tokenizer.
    tok: Any = AutoTokenizer.from_pretrained(model)
    client = RolloutClient(url, tokenizer=tok)
    weights = {0: model}
    events: dict[str, list[Event]] = {}
    progress = demo_loop.Progress(steps=args.steps)
    cfg = demo_loop.LoopConfig(
        steps=args.steps,
        prompts=args.prompts,
        samples=args.samples,
        max_tokens=args.max_tokens,
        kill_step=min(1, args.steps - 1),
    )
    try:
        for name in ("demo-worker-a", "demo-worker-b"):
            procs.worker(name)  # they load the model meanwhile
        api_url = procs.api()
        say(f"API up at {api_url} (/healthz ok); 2 workers starting")
        loop = demo_loop.trainer_loop(
            client, cfg, tok.encode, weights, tmp, procs.kill, progress, events
        )
        live = sys.stdout.isatty() and not args.json
        if live:
            async with demo_display.live_display(client, progress):
                results = await loop
        else:
            progress.echo = say
            results = await loop
        stats = await client.stats()
    finally:
        procs.stop_all()
        await client.aclose()
    if live:
        for n in progress.notes:
            say(n)
    say("checking every greedy rollout against an uninterrupted run per weight segment ...")
    checked, mismatches = await demo_reference.check(model, weights, results)
    plot = _plot(args.plot, events, say)
    report = _report(results, events, progress, stats.tokens, checked, len(mismatches))
    report.update(api_url=api_url, plot=plot, wall_s=round(time.monotonic() - t0, 1))
    report["mismatch_details"] = [m.describe() for m in mismatches]
    return report


def _plot(path: str, events: dict[str, list[Event]], say: Any) -> str | None:
    from workers.ops.timeline_plot import PlotUnavailable, plot_timelines  # noqa: PLC0415

    lines = [timeline.build(e) for e in events.values() if e]
    interrupted = [t for t in lines if t.state.aborts > 0]
    rest = [t for t in lines if t.state.aborts == 0]
    chosen = (interrupted + rest)[: max(PLOT_ROWS, len(interrupted))]
    chosen.sort(key=lambda t: t.entries[0].at)
    try:
        plot_timelines(chosen, path)
    except (PlotUnavailable, ValueError, OSError) as exc:
        # The picture is a bonus: the check and the report stand without it.
        say(f"no picture: {exc}")
        return None
    return str(Path(path).resolve())


def _report(
    results: list[RolloutResult],
    events: dict[str, list[Event]],
    progress: demo_loop.Progress,
    appended: int,
    checked: int,
    mismatches: int,
) -> dict[str, Any]:
    all_events = [e for log in events.values() for e in log]
    reasons = Counter(e.reason.value for e in all_events if isinstance(e, Aborted))
    kept = sum(len(r.response_token_ids) for r in results)
    return {
        "rollouts_submitted": progress.submitted,
        "rollouts_done": sum(r.status is Status.DONE for r in results),
        "tokens": kept,
        "tokens_appended": appended,
        # Tokens appended more than once: saved by an attempt, then generated again.
        "tokens_regenerated": max(appended - kept, 0),
        "weight_updates": progress.weight_updates,
        "worker_kills": progress.worker_kills,
        "aborts": sum(reasons.values()),
        "aborts_by_reason": dict(reasons),
        "resumes": sum(isinstance(e, Resumed) for e in all_events),
        "rollouts_interrupted": sum(r.aborts > 0 for r in results),
        "rollouts_multi_version": sum(len(r.version_segments) > 1 for r in results),
        "segments_checked": checked,
        "mismatches": mismatches,
        # What the loop did when (the kill, each update): the live display's lines, kept.
        "notes": list(progress.notes),
    }


@contextlib.contextmanager
def _redis(url: str | None, tmp: Path, say: Any) -> Iterator[str]:
    if url:
        say(f"using Redis at {redact(url)}")
        yield url
        return
    with RedisServer(tmp / "redis") as server:
        say(f"started redis-server on {redact(server.url)} (AOF, appendfsync always)")
        yield server.url


def run(args: argparse.Namespace) -> int:
    try:
        url = redis_options.resolve(args, use_env=False)
    except InvalidRedisUrl as exc:
        # Its message names the file, never the URL.
        print(f"rollouts demo: error: {exc}", file=sys.stderr)
        return 2
    if not url and shutil.which("redis-server") is None:
        print(
            "rollouts demo: needs redis-server on PATH (apt-get install redis-server, "
            "or brew install redis), or --redis URL",
            file=sys.stderr,
        )
        return 2
    for flag in ("steps", "prompts", "samples", "max_tokens"):
        if getattr(args, flag) < 1:
            print(f"rollouts demo: error: --{flag.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    quiet = args.json

    def say(text: str) -> None:
        if not quiet:
            print(text, flush=True)

    try:
        with tempfile.TemporaryDirectory(prefix="rollouts-demo-") as tmp:
            # torch leaves an (empty) compile cache directory in $TMPDIR: keep it in ours,
            # for this process and every one it starts, so that it goes with it.
            os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(tmp) / "torchinductor"))
            model = _model(args.model, say)
            with _redis(url, Path(tmp), say) as redis_url:
                report = asyncio.run(_demo(args, redis_url, model, Path(tmp), say))
    except KeyboardInterrupt:
        # Every process was stopped and the temporary directory removed on the way out.
        print("rollouts demo: interrupted; stopped everything it started", file=sys.stderr)
        return 130
    details = report.pop("mismatch_details")
    if args.json:
        print(json.dumps(report))
        for d in details:
            print(f"MISMATCH {d}", file=sys.stderr)
    else:
        print(demo_display.report_text(report, details))
    everything = report["rollouts_done"] == report["rollouts_submitted"]
    return 0 if report["mismatches"] == 0 and everything else 1
