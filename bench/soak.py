"""A soak: the demo's RL loop for ``--minutes`` under random faults, then an audit of every log.

    python bench/soak.py --minutes 30            # figures and the audit, as text
    python bench/soak.py --minutes 1 --json      # one JSON object (what CI's test reads)

It starts its own redis-server (AOF, ``appendfsync always``, ``maxmemory-policy noeviction``)
in a temporary directory, the HTTP API and ``--workers`` worker processes (the synthetic
engine by default: resume-exact and paced, so greedy equality costs nothing to check;
``--engine cpu`` runs the tiny MoE model, checked per weight segment as the demo does). One
worker's wall clock can be stepped (libfaketime), one reaches Redis through a proxy that can
turn slow and drop connections (``soak_fleet``). The trainer (``soak_trainer``) runs steps
until the time is up while faults come at random moments (``soak_faults``: SIGKILL and SIGTERM
of workers, Redis restarts, weight updates, clock steps, a short OOM, a slow link). Then every
spell of a fault is ended, the last rollouts are drained (bounded), and the audit
(``soak_audit``, ``soak_memory``) says whether anything was lost, doubled, wrong, stranded or
left in Redis. Exit status: 0 if the audit passed, 1 if not, 2 for a usage error, 130 if
interrupted. Everything it starts it stops, on Ctrl-C too; every wait is bounded (start-up,
``--step-timeout`` per step, ``--drain-timeout``, ``STOP_S`` per process).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

# The soak's modules (run as a script, bench/ is on the path already), then the project ahead
# of an installed copy.
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from soak_audit import REFERENCE, Audit
from soak_faults import KINDS, Faults, write_clock
from soak_fleet import Fleet, find_libfaketime
from soak_link import LinkProxy
from soak_memory import Inventory, inventory, judge
from soak_trainer import Trainer, TrainerConfig, Weights, retrying

from store import defaults
from store.client import RolloutClient
from store.connection import connect, connect_sync
from store.inspect import StuckRollout, find_stuck
from store.redis_server import RedisServer

# The synthetic engine's pace: 200 tokens/s per rollout in steps of 4, so a fault lands
# mid-generation (unpaced, a rollout is over before a kill can find it) at a fifth of the
# CPU of one-token steps.
PACE = {"tokens_per_chunk": 4, "token_delay_s": 0.005}
REDIS_CONFIG = {"maxmemory-policy": "noeviction"}
START_S = {"synthetic": 60.0, "cpu": 300.0}  # workers registered, bounded
API_PROBE_S = 2.0
# Lines of the workers' logs counted for the report: what the faults made them do.
LOG_MARKS = (
    ("tracebacks", "Traceback"),
    ("takeovers", "event=takeover"),
    ("jobs_superseded", "event=superseded"),
    ("abandoned_jobs_requeued", "abandoned by a dead worker"),
    ("stranded_rollouts_requeued", "event=stranded"),
    ("quarantined", "event=quarantine"),
)
DRAIN_LOOK_S = 15.0  # how often the drain asks whether what it waits for is stuck
MEMORY = "memory_back_to_baseline"
# How long the fleet may take after the last ack to clear what dead workers left in rq: their
# runs' executions lapse (RQ_EXECUTION_TTL_S), a reaper pass sweeps them back, a worker deletes.
SETTLE_S = defaults.RQ_EXECUTION_TTL_S + 15.0
HARNESS = "harness_ran_clean"  # the soak's own reads failed: said, never a traceback
API = "api_no_500"


class SoakError(RuntimeError):
    """The soak could not run (its workers did not start): no audit to give."""


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=5.0, help="fault phase length (default 5)")
    p.add_argument("--seed", type=int, default=0, help="seed of prompts and faults (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON object (a switch)")
    p.add_argument("--engine", choices=("synthetic", "cpu"), default="synthetic")
    p.add_argument("--workers", type=int, default=3, help="worker processes (default 3)")
    p.add_argument("--concurrency", type=int, default=4, help="per worker (default 4)")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step (default 8)")
    p.add_argument("--samples", type=int, default=4, help="samples per prompt (default 4)")
    p.add_argument(
        "--tokens", default=None,
        help="max_tokens range MIN,MAX (default 64,512 synthetic; 16,48 cpu)",
    )  # fmt: skip
    p.add_argument(
        "--fault-every", type=float, default=6.0, help="mean seconds between faults (default 6)"
    )
    p.add_argument(
        "--faults",
        default=",".join(KINDS),
        help=f"kinds to inject, '' for none (default {','.join(KINDS)})",
    )
    p.add_argument(
        "--step-timeout",
        type=float,
        default=60.0,
        help="a step not consumed by then is left for the drain (default 60 s; a step takes ~10)",
    )
    p.add_argument(
        "--drain-timeout", type=float, default=120.0, help="for the last rollouts (default 120 s)"
    )
    p.add_argument("--logs", help="copy every process's log into this directory at the end")
    p.add_argument("--libfaketime", help="libfaketimeMT.so.1 (default: found under /usr/lib)")
    return p.parse_args(argv)


def _check(args: argparse.Namespace) -> str | None:
    kinds = tuple(k for k in args.faults.split(",") if k)
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        return f"unknown faults {unknown}; choose from {', '.join(KINDS)}"
    args.kinds = kinds
    if args.minutes <= 0 or args.workers < 2 or args.concurrency < 1 or args.fault_every <= 0:
        return "--minutes and --fault-every must be > 0, --workers >= 2, --concurrency >= 1"
    lo, hi = (
        int(x)
        for x in (args.tokens or ("64,512" if args.engine == "synthetic" else "16,48")).split(",")
    )
    if not 1 <= lo <= hi:
        return "--tokens must be MIN,MAX with 1 <= MIN <= MAX"
    args.token_range = (lo, hi)
    if shutil.which("redis-server") is None:
        return "needs redis-server on PATH (apt-get install redis-server)"
    if "clock_step" in kinds:
        args.libfaketime = args.libfaketime or find_libfaketime()
        if not args.libfaketime or not Path(args.libfaketime).exists():
            return "clock_step needs libfaketime (apt-get install faketime), or --faults without it"
    return None


class Run:
    """Everything one soak started, stopped in ``close`` whatever happened."""

    def __init__(
        self, args: argparse.Namespace, tmp: Path, server: RedisServer, say: Callable[[str], None]
    ) -> None:
        self.args, self.tmp, self.server, self.say = args, tmp, server, say
        self.rng = random.Random(args.seed)
        self.audit = Audit()
        self.retries: Counter[str] = Counter()
        self.api_answers: Counter[str] = Counter()
        self.clock_file = tmp / "clock.rc" if "clock_step" in args.kinds else None
        self.proxy = LinkProxy(server.port, seed=args.seed) if "slow_link" in args.kinds else None
        self.model: Path | None = None
        self.weight_dirs: dict[int, Path] = {}
        self.fleet: Fleet | None = None
        self.client: RolloutClient | None = None
        self.admin: Any = None
        self.weights: Weights | None = None
        self.trainer: Trainer | None = None
        self.durations: dict[str, float] = {}

    async def checkpoint(self, version: int) -> str:
        """The weights of ``version``: a name for the synthetic engine (its tokens ignore
        weights); for the CPU engine, the previous version perturbed (``demo_loop.perturb``)."""
        if self.model is None:
            return f"synthetic-v{version}"
        from workers.demo.loop import perturb

        path = self.tmp / "weights" / f"v{version}"
        await asyncio.to_thread(perturb, self.weight_dirs[version - 1], path, version)
        self.weight_dirs[version] = path
        return str(path)

    def _set_up(self) -> None:
        args = self.args
        logs = self.tmp / "logs"
        logs.mkdir()
        if args.engine == "cpu":
            from workers.demo.run import _model

            self.model = _model(None, self.say)
            self.weight_dirs[0] = self.model
        if self.clock_file is not None:
            write_clock(self.clock_file, 0)
        link_url = None
        if self.proxy is not None:
            link_url = f"redis://127.0.0.1:{self.proxy.start()}/0"
        self.fleet = Fleet(
            self.server.url, self.model, logs, workers=args.workers,
            concurrency=args.concurrency, synthetic=PACE, link_url=link_url,
            clock_file=self.clock_file, libfaketime=args.libfaketime,
        )  # fmt: skip
        self.client = RolloutClient(self.server.url)
        self.admin = connect(self.server.url)
        self.weights = Weights(self.client, self.checkpoint, self.retries)
        vocab = 32_000 if self.model is None else _vocab(self.model)
        cfg = TrainerConfig(args.prompts, args.samples, args.token_range, args.step_timeout, vocab)
        self.trainer = Trainer(
            self.client, cfg, self.rng, self.audit, self.weights, self.retries,
            synthetic_reference=self.model is None,
        )  # fmt: skip

    async def main(self) -> dict[str, Any]:
        """Start, warm up, run the faults with the trainer, drain, audit; the report."""
        args, say, t = self.args, self.say, time.monotonic()
        self._set_up()
        fleet, trainer = self.fleet, self.trainer
        assert fleet is not None and trainer is not None and self.client is not None
        fleet.start_all()
        api_url = fleet.api()
        await self._registered(self.client, fleet, START_S[args.engine])
        say(f"{args.workers} workers and the API up ({api_url}); warming up")
        baseline = await self._warm_up()
        self.durations["start_s"], t = time.monotonic() - t, time.monotonic()
        say(f"fault phase: {args.minutes} min, faults {', '.join(args.kinds)}")
        faults = Faults(
            rng=random.Random(args.seed + 1), kinds=args.kinds, every_s=args.fault_every,
            fleet=fleet, server=self.server, admin=self.admin, weights=self.weights,
            proxy=self.proxy, clock_file=self.clock_file, counts=self.retries, say=say,
        )  # fmt: skip
        until = time.monotonic() + args.minutes * 60
        probe = asyncio.create_task(self._probe_api(api_url))
        injecting = asyncio.create_task(faults.run(until))
        try:
            await trainer.run(until)
            await injecting
        finally:
            injecting.cancel()
            await faults.restore()
        self.durations["fault_phase_s"], t = time.monotonic() - t, time.monotonic()
        say(f"faults over after {trainer.steps} steps; draining the last rollouts")
        undelivered = await self._drain(trainer)
        try:
            await self._stranded(trainer, undelivered)
        except Exception as exc:
            # Its rollouts are still counted as never ended (``every_rollout_ended``).
            self.audit.record(HARNESS, f"auditing the stranded rollouts: {_named(exc)}")
            for rid in undelivered:
                if rid not in self.audit.audited:
                    self.audit.missing(rid, "never delivered (not audited: see harness_ran_clean)")
        self.durations["drain_s"], t = time.monotonic() - t, time.monotonic()
        probe.cancel()
        await self._reference_by_segment(trainer)
        await self._settle(baseline)
        await asyncio.to_thread(fleet.stop_all)
        try:
            after: Inventory | None = await inventory(self.admin)
        except Exception as exc:
            self.audit.skip(MEMORY, f"no inventory after the run: {_named(exc)}")
            after = None
        else:
            self._judge_memory(baseline, after)
        self._judge_api()
        for what in faults.failed:
            self.audit.record("faults_injected", what)
        self.durations["audit_s"] = time.monotonic() - t
        return self._report(faults, baseline, after, undelivered)

    async def close(self) -> None:
        if self.fleet is not None:
            await asyncio.to_thread(self.fleet.stop_all)
            if self.args.logs:
                target = Path(self.args.logs)
                target.mkdir(parents=True, exist_ok=True)
                for f in self.fleet.logs.glob("*.log"):
                    shutil.copy(f, target / f.name)
        if self.proxy is not None:
            self.proxy.stop()
        for c in (self.client, self.admin):
            if c is not None:
                with contextlib.suppress(Exception):
                    # Redis may be gone already (an interrupted restart): nothing to close.
                    await c.aclose()

    async def _registered(self, client: RolloutClient, fleet: Fleet, timeout: float) -> None:
        want = {s.name for s in fleet.slots}
        deadline = time.monotonic() + timeout
        while not want <= {w.worker_id for w in (await client.stats()).workers}:
            dead = [n for n, p in fleet.workers.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                what = dead or sorted(want)
                raise SoakError(f"workers did not come up: {what} (--logs DIR keeps their logs)")
            await asyncio.sleep(0.2)

    async def _warm_up(self) -> Inventory:
        """One small batch, run and acknowledged, and weights v1: what stays for good exists
        before the baseline is taken."""
        from statemachine import RolloutRequest, SamplingParams

        client, weights = self.client, self.weights
        assert client is not None and weights is not None
        sampling = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        ids = await client.submit(
            [RolloutRequest(prompt_token_ids=(11, 12, 13), sampling=sampling)] * 4,
            batch_id="soak-warm-up",
        )
        await client.wait(list(ids), timeout=120)
        await client.ack(batch_id="soak-warm-up")
        await weights.publish_next()
        await asyncio.sleep(2.0)  # the workers load v1 and beat
        return await inventory(self.admin)

    async def _drain(self, trainer: Trainer) -> list[str]:
        """The rollouts still running when the faults ended, read to their end: until the
        drain timeout, or sooner once every one left is stuck (``rollouts stuck``: nothing
        will ever move it)."""
        deadline = time.monotonic() + self.args.drain_timeout
        while True:
            undelivered = await trainer.drain(min(deadline, time.monotonic() + DRAIN_LOOK_S))
            if not undelivered or time.monotonic() >= deadline:
                break
            stuck = await self._stuck()
            if all(rid in stuck for rid in undelivered):
                self.say(f"{len(undelivered)} rollouts stuck: not waiting for them")
                break
        await trainer.ack_leftovers()
        return undelivered

    async def _stuck(self) -> dict[str, StuckRollout]:
        """``rollouts stuck``'s view (``store.inspect.find_stuck``); if it fails, the
        audit says so and the soak goes on without its reasons."""
        assert self.client is not None
        conn = connect_sync(self.server.url)
        try:
            return {s.rollout_id: s for s in await find_stuck(self.client.store, conn)}
        except Exception as exc:
            self.audit.record(HARNESS, f"rollouts stuck (find_stuck) raised {_named(exc)}")
            return {}
        finally:
            conn.close()

    async def _stranded(self, trainer: Trainer, undelivered: list[str]) -> None:
        """Audit the rollouts that never reached the trainer, each with why (``rollouts
        stuck``'s reasons where it finds one), then cancel and acknowledge them (and their
        batches) so that the memory check measures the rest."""
        if not undelivered:
            return
        assert self.client is not None
        store = self.client.store
        stuck = await self._stuck()
        states = dict(zip(undelivered, await store.load_many(undelivered), strict=True))
        for rid in undelivered:
            s = stuck.get(rid)
            state = states[rid]
            if s is not None:
                why = f"stuck ({s.kind}): {s.why}"
            elif isinstance(state, Exception):
                why = f"unreadable: {type(state).__name__}: {state}"
            else:
                why = (
                    f"still {state.status.value} (attempt {state.attempt} on "
                    f"{state.worker_id}) after the drain, {state.num_tokens} tokens saved"
                )
            await trainer.audit_one(rid, None, stranded=why)
        with contextlib.suppress(Exception):
            # Unreadable ones refuse: the memory check then names what is left.
            await retrying("cancel", lambda: self.client.cancel(undelivered), self.retries)
        with contextlib.suppress(Exception):
            await retrying("ack", lambda: self.client.ack(undelivered), self.retries)
        for reader in trainer.readers:
            if not reader.complete:
                await trainer.ack_batch(reader)

    async def _reference_by_segment(self, trainer: Trainer) -> None:
        """CPU engine: every delivered rollout against an uninterrupted greedy run of each
        weight version it used (``demo_reference``: model load and generation, minutes)."""
        if self.model is None or not trainer.results:
            return
        from workers.demo import reference as demo_reference

        self.say(f"checking {len(trainer.results)} rollouts per weight segment ...")
        done = [r for r in trainer.results if r.status.value == "done"]
        try:
            _, mismatches = await demo_reference.check(self.model, self.weight_dirs, done)
        except Exception as exc:
            self.audit.skip(REFERENCE, f"the reference run failed: {_named(exc)}")
            return
        for m in mismatches:
            self.audit.record(REFERENCE, m.describe())

    async def _probe_api(self, url: str) -> None:
        """The API's answers while the faults run: a 503 says why (Redis down, full), a 500
        is an internal error (never right)."""
        while True:
            for path in ("/healthz", "/v1/stats"):
                code = await asyncio.to_thread(_get, url + path)
                self.api_answers[f"{path} {code}"] += 1
                if code == "500":
                    self.audit.record(API, f"GET {path} answered 500")
            await asyncio.sleep(API_PROBE_S)

    async def _settle(self, baseline: Inventory) -> None:
        """Leave the fleet running until Redis is back to its baseline, for at most
        ``SETTLE_S``: a killed worker's run of a job stays "started" in rq until its execution
        lapses (``RQ_EXECUTION_TTL_S``); the fleet's sweep then gives it back, and the worker
        that takes it finds the rollout acknowledged and deletes the job. The memory check
        judges what is left after that, as Redis holds it for good."""
        t = time.monotonic()
        while time.monotonic() - t < SETTLE_S:
            try:
                if not judge(baseline, await inventory(self.admin)):
                    break
            except Exception:
                break  # the inventory after the run says why
            await asyncio.sleep(1.0)
        self.durations["settle_s"] = time.monotonic() - t

    def _judge_memory(self, before: Inventory, after: Inventory) -> None:
        problems = judge(before, after)
        for p in problems:
            self.audit.record(MEMORY, p)
        if not problems:
            self.audit.passing(MEMORY)

    def _judge_api(self) -> None:
        if not any(k.endswith(" 500") for k in self.api_answers):
            self.audit.passing(API)

    def _report(
        self, faults: Faults, before: Inventory, after: Inventory | None, undelivered: list[str]
    ) -> dict[str, Any]:
        trainer, fleet = self.trainer, self.fleet
        assert trainer is not None and fleet is not None
        durations = {**self.durations, "total_s": sum(self.durations.values())}
        link = None
        if self.proxy is not None:
            link = {"connections": self.proxy.connections, "drops": self.proxy.drops}
        a = self.audit
        # Judges false losses: before `passed`.
        budgets = a.budgets(faults.killed_attempts, faults.stopped_attempts)
        lost = sum(a.tokens_lost.values())
        return {
            "passed": a.passed,
            "seed": self.args.seed,
            "engine": self.args.engine,
            "minutes": self.args.minutes,
            "durations": {k: round(v, 1) for k, v in durations.items()},
            "steps": trainer.steps,
            "rollouts_submitted": len(trainer.submitted),
            "rollouts_by_status": dict(a.statuses),
            "rollouts_done": a.statuses["done"],
            "rollouts_failed": a.statuses["failed"],
            "rollouts_failed_by_class": dict(a.failures),
            "rollouts_never_delivered": len(undelivered),
            "faults": dict(faults.injected),
            "faults_not_injected": faults.failed,
            "fault_timeline": faults.timeline,
            "weight_versions": trainer.weights.version,
            "aborts_by_reason": dict(a.aborts),
            "budgets": budgets,
            "tokens_saved": a.tokens_saved,
            "tokens_lost": lost,
            "tokens_lost_by_cause": dict(a.tokens_lost),
            "trainer_retries": dict(self.retries),
            "trainer_errors": trainer.errors,
            "sigterm_overran": fleet.term_overran,
            "link": link,
            "api_answers": dict(self.api_answers),
            "worker_log_lines": {what: fleet.log_lines(needle) for what, needle in LOG_MARKS},
            "memory_before": before.figures(),
            "memory_after": after.figures() if after is not None else None,
            "audit": a.summary(),
            "problem_logs": a.problem_logs,
        }


def _named(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _vocab(model: Path) -> int:
    return int(json.loads((model / "config.json").read_text())["vocab_size"])


def _get(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return str(r.status)
    except urllib.error.HTTPError as exc:
        return str(exc.code)
    except OSError as exc:
        # No answer at all (the API restarting its connection pool, a timeout).
        return type(exc).__name__


def report_text(r: dict[str, Any]) -> str:
    b = r["budgets"]
    lines = [
        "",
        f"soak: {r['minutes']} min of faults, seed {r['seed']}, {r['engine']} engine, "
        f"{r['steps']} steps, durations {r['durations']}",
        f"rollouts: {r['rollouts_submitted']} submitted, {r['rollouts_done']} done, "
        f"{r['rollouts_failed']} failed {r['rollouts_failed_by_class'] or ''}, "
        f"{r['rollouts_never_delivered']} never delivered; by status {r['rollouts_by_status']}",
        f"faults: {r['faults']}"
        + (f"; not injected: {r['faults_not_injected']}" if r["faults_not_injected"] else ""),
        f"weights: {r['weight_versions']} versions published; link: {r['link']}",
        f"aborts by reason: {r['aborts_by_reason']}",
        f"budgets: {b['worker_lost']} worker_lost charged ({b['worker_lost_by_how']}; of "
        f"workers {b['worker_lost_of']}); rollouts by worker_lost charged "
        f"{b['rollouts_by_worker_lost_charged']}, at most {b['max_worker_lost_per_rollout']}",
        f"tokens: {r['tokens_saved']} saved, {r['tokens_lost']} lost "
        f"{r['tokens_lost_by_cause'] or ''}",
        f"trainer: retries {r['trainer_retries']}, errors {r['trainer_errors']}; "
        f"API answers {r['api_answers']}",
        f"worker logs: {r['worker_log_lines']}",
        _memory_text(r["memory_before"], r["memory_after"]),
        "audit:",
    ]
    for name, c in r["audit"].items():
        mark = "ok  " if c["passed"] else "FAIL"
        detail = c.get("skipped", "") or (f"{c['failures']} failures" if c["failures"] else "")
        lines.append(f"  {mark} {name} {detail}")
        lines += [f"         {e}" for e in c.get("examples", [])]
    for rid, log in r["problem_logs"].items():
        lines.append(f"log of {rid}:")
        lines += [f"    {e}" for e in log]
    lines.append("PASSED" if r["passed"] else "FAILED")
    return "\n".join(lines)


def _memory_text(before: dict[str, Any], after: dict[str, Any] | None) -> str:
    if after is None:
        return f"memory: keyspace {before['comparable_bytes']} B before; none read after"
    return (
        f"memory: keyspace {before['comparable_bytes']} B before, {after['comparable_bytes']} B "
        f"after (workers' keys and the weight log aside); keys after {after['keys']}; "
        f"used_memory {before['info']['used_memory']} -> {after['info']['used_memory']}"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    problem = _check(args)
    if problem:
        print(f"soak: error: {problem}", file=sys.stderr)
        return 2

    def say(text: str) -> None:
        if not args.json:
            print(text, flush=True)

    try:
        with tempfile.TemporaryDirectory(prefix="rollouts-soak-") as tmp:
            os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(tmp) / "torchinductor"))
            with RedisServer(Path(tmp) / "redis", config=REDIS_CONFIG) as server:
                say(f"redis-server on port {server.port} (AOF always, noeviction)")
                report = asyncio.run(_soak(args, Path(tmp), server, say))
    except SoakError as exc:
        print(f"soak: error: {exc}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("soak: interrupted; stopped everything it started", file=sys.stderr)
        return 130
    print(json.dumps(report) if args.json else report_text(report), flush=True)
    return 0 if report["passed"] else 1


async def _soak(
    args: argparse.Namespace, tmp: Path, server: RedisServer, say: Callable[[str], None]
) -> dict[str, Any]:
    run = Run(args, tmp, server, say)
    # SIGTERM as Ctrl-C (asyncio.run's own SIGINT handler does the same): the run is
    # cancelled, and its `finally` stops everything it started.
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    try:
        return await run.main()
    finally:
        await run.close()


if __name__ == "__main__":
    sys.exit(main())
