"""What durable episodes cost, measured side by side in one run.

The workload: ``--episodes`` episodes at once, each ``--turns`` turns of short generation that
end at a tool call, and an instant tool whose observation is ``--observation`` tokens; the
last turn's call ends the episode at its ``max_turns`` budget, so each episode runs ``turns``
turns and ``turns - 1`` tools. One synthetic engine, paced at ``--token-ms`` per decode step
(a GPU's cadence: every request gets a token per step), with vocabulary ``--vocab``: a turn
ends at the tool-call token within ``vocab`` tokens (``vocab / 2`` on average).

(a) direct:  the same turns driven directly on the engine: each turn's prompt the whole context
    so far, the tool run in-process, nothing recorded; each turn a ``generate`` stream of its
    own (the default), or with ``--direct steps`` the engine's whole steps, as the worker
    drives it (its requests then share one step clock: every token comes at the step cadence,
    where 16 streams of their own, each on its own timer, came ~6% slower on this machine);
(b) durable: through the system: a real ``Worker`` (rq jobs, leases, group-commit checkpoints,
    the turn's end and ``ToolCallRequested`` in one chain, AOF ``appendfsync always``) and
    ``--runners`` environment loops on ``EnvironmentClient`` (claim, result; the result
    pushes the next turn's job).

(a) and (b) run ``--rounds`` times in alternating order (ABBA); ``ratio`` is the median of
the pairs' direct/durable times. (b)'s contexts are checked against (a)'s, so the two provably
did the same work. Redis bytes come from the episodes' logs as stored: per turn (the whole
log over the turns) and per tool call (its requested, claimed and result entries);
``observation_bytes_ratio`` is the stored bytes of the result entries over their observation
tokens' payload (4 bytes each, int32), the target being <= 1.2.

``python bench/bench_episodes.py --json`` prints one JSON object (``ratio``,
``observation_bytes_ratio`` and the rest).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import redis

from statemachine import RolloutRequest, SamplingParams, Status, codec
from statemachine.episode import EpisodeSpec, ToolSpec
from statemachine.episode_events import ToolCallClaimed, ToolCallRequested, ToolResultRecorded
from store.client import RolloutClient
from store.environment import EnvironmentClient
from store.redis_server import RedisServer
from workers.engines.base import EngineRequest, join_chunks
from workers.engines.synthetic import SyntheticEngine
from workers.env import Call
from workers.worker import Worker, WorkerConfig

STOP = 5  # the tool-call token
PROMPT_LEN = 16
OBS_ENV, VOCAB_ENV = "BENCH_EPISODES_OBSERVATION", "BENCH_EPISODES_VOCAB"
ROOT = Path(__file__).resolve().parent.parent


def tool(turn: list[int], n: int, vocab: int) -> list[int]:
    """The instant tool: an observation of ``n`` tokens that depends only on the turn."""
    return [(sum(turn) + 3 * j) % vocab for j in range(n)]


async def calc(call: Call) -> list[int]:
    """The instant tool as ``rollouts env`` serves it (``--runner process``): the workload's
    sizes come from the environment the bench starts the runner with."""
    return tool(call.args["token_ids"], int(os.environ[OBS_ENV]), int(os.environ[VOCAB_ENV]))


def start_runner(
    url: str, queue: str, args: argparse.Namespace, log: Path
) -> subprocess.Popen[bytes]:
    """``rollouts env`` serving ``calc`` on ``queue``, ``--runners`` calls at once: a process
    of its own, as an environment is deployed (its log, a line per claim and per result, to
    ``log``)."""
    env = {**os.environ, OBS_ENV: str(args.observation), VOCAB_ENV: str(args.vocab)}
    cmd = [sys.executable, "-m", "workers.cli", "env", "--redis", url, "--queue", queue,
           "--tools", "bench.bench_episodes:calc", "--concurrency", str(args.runners)]  # fmt: skip
    start = log.stat().st_size if log.exists() else 0
    with log.open("ab") as out:
        process = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    # Timed from when it serves: its start (imports) is a deployment's, not a turn's.
    deadline = time.monotonic() + 120
    while b"env_runner_started" not in log.read_bytes()[start:]:
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"rollouts env did not start: see {log}")
        time.sleep(0.05)
    return process


def prompts(episodes: int, vocab: int) -> list[tuple[int, ...]]:
    return [tuple((7 * i + j) % vocab for j in range(PROMPT_LEN)) for i in range(episodes)]


async def direct(engine: SyntheticEngine, args: argparse.Namespace) -> tuple[float, list]:
    """(seconds, context per episode): the turns on the engine alone."""

    async def one(i: int, prompt: tuple[int, ...]) -> list[int]:
        context: list[int] = []
        sampled = 0
        for turn in range(args.turns):
            request = EngineRequest(
                request_id=f"direct-{time.monotonic_ns()}-{i}-{turn}",
                prompt_token_ids=prompt + tuple(context),
                sampling=SamplingParams(
                    max_tokens=args.max_tokens - sampled, stop_token_ids=(STOP,), temperature=0.0
                ),
            )
            chunks = [c async for c in engine.generate(request)]
            ids = join_chunks(chunks).token_ids.tolist()
            context += ids
            sampled += len(ids)
            if turn < args.turns - 1:
                context += tool(ids, args.observation, args.vocab)
        return context

    t0 = time.perf_counter()
    out = await asyncio.gather(
        *(one(i, p) for i, p in enumerate(prompts(args.episodes, args.vocab)))
    )
    return time.perf_counter() - t0, list(out)


async def direct_steps(engine: SyntheticEngine, args: argparse.Namespace) -> tuple[float, list]:
    """``direct`` through the engine's whole steps (``add``/``steps``), as the worker consumes
    them: a turn that ends at a step has its tool run and its next turn added before the
    next step, whose first token it gets."""
    starts = prompts(args.episodes, args.vocab)
    contexts: list[list[int]] = [[] for _ in starts]
    sampled, turns = [0] * len(starts), [0] * len(starts)
    running: dict[str, tuple[int, list[int]]] = {}

    async def start(i: int) -> None:
        request = EngineRequest(
            request_id=f"steps-{time.monotonic_ns()}-{i}-{turns[i]}",
            prompt_token_ids=starts[i] + tuple(contexts[i]),
            sampling=SamplingParams(
                max_tokens=args.max_tokens - sampled[i], stop_token_ids=(STOP,), temperature=0.0
            ),
        )
        running[request.request_id] = (i, [])
        await engine.add(request)

    t0 = time.perf_counter()
    for i in range(len(starts)):
        await start(i)
    async for step in engine.steps():
        counts = [1] * len(step.request_ids) if step.counts is None else step.counts.tolist()
        ids, at = step.token_ids.tolist(), 0
        for rid, n in zip(step.request_ids, counts, strict=True):
            running[rid][1].extend(ids[at : at + n])
            at += n
        for rid in step.ends:
            i, turn = running.pop(rid)
            contexts[i] += turn
            sampled[i] += len(turn)
            turns[i] += 1
            if turns[i] < args.turns:
                contexts[i] += tool(turn, args.observation, args.vocab)
                await start(i)
    return time.perf_counter() - t0, contexts


async def durable(
    engine: SyntheticEngine, url: str, args: argparse.Namespace, round_: int, runner_log: Path
) -> tuple[float, list, dict[str, Any]]:
    """(seconds, context per episode, Redis bytes): the turns through the system."""
    queue = f"bench-ep-{round_}"
    client = RolloutClient(url, queue_name=queue)
    env = EnvironmentClient(client.store, redis.Redis.from_url(url))
    spec = EpisodeSpec(
        tool_call_stop_token_ids=(STOP,),
        tools=(ToolSpec(name="calc", effect="idempotent"),),
        max_turns=args.turns,
        env_queue=queue,
    )
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    reqs = [
        RolloutRequest(prompt_token_ids=p, sampling=sampling, episode=spec)
        for p in prompts(args.episodes, args.vocab)
    ]
    worker = Worker(
        WorkerConfig(redis_url=url, queues=(queue,), max_concurrency=args.episodes), engine
    )
    running = asyncio.create_task(worker.run())
    done = asyncio.Event()

    async def runner(k: int) -> None:
        while not done.is_set():
            claim = await env.claim(queue, f"bench-env-{k}", timeout_s=0.2)
            if claim is None:
                continue
            turn = json.loads(claim.arguments)["token_ids"]
            await env.record_result(claim, tool(turn, args.observation, args.vocab), seconds=0.0)

    if args.runner == "process":
        process, runners = start_runner(url, queue, args, runner_log), []
    else:
        process, runners = None, [asyncio.create_task(runner(k)) for k in range(args.runners)]
    t0 = time.perf_counter()
    ids = await client.submit(reqs)
    results = await client.wait(ids, timeout=600)
    seconds = time.perf_counter() - t0
    done.set()
    await asyncio.gather(*runners)
    if process is not None:
        process.terminate()
        process.wait(timeout=30)
    worker.request_stop()
    await running
    bad = [r.rollout_id for r in results if r.status is not Status.DONE]
    if bad:
        raise SystemExit(f"episodes not done: {bad[:5]}")
    contexts = [(await client.store.load(rid)).context_token_ids.tolist() for rid in ids]
    stored = await _stored_bytes(client, list(ids))
    env.connection.close()
    await client.aclose()
    return seconds, contexts, stored


async def _stored_bytes(client: RolloutClient, ids: list[str]) -> dict[str, Any]:
    """Bytes of the episodes' log entries as Redis holds them (the record field's value), by
    kind, with the observation tokens they carry."""
    log = {"all": 0, "call": 0, "result": 0, "observation_tokens": 0, "calls": 0, "turns": 0}
    for rid in ids:
        state = await client.store.load(rid)
        log["turns"] += len(state.turns)
        for entry_id, fields in await client.store.redis.xrange(client.store.keys.log(rid)):
            record = fields[b"e"]
            log["all"] += len(record)
            seq = int(entry_id.split(b"-")[1])
            event = codec.decode(record, rollout_id=rid, seq=seq)
            if isinstance(event, ToolCallRequested | ToolCallClaimed | ToolResultRecorded):
                log["call"] += len(record)
            if isinstance(event, ToolResultRecorded):
                log["result"] += len(record)
                log["calls"] += 1
        log["observation_tokens"] += state.observation_tokens
    return log


async def main(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-episodes-") as tmp:
        server = RedisServer(Path(tmp))
        server.start()
        try:
            return await _measure(server.url, args, Path(tmp))
        finally:
            server.close()


async def _measure(url: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    engine = SyntheticEngine(
        vocab=args.vocab, tokens_per_chunk=1, token_delay_s=args.token_ms / 1000
    )
    direct_s: list[float] = []
    durable_s: list[float] = []
    stored: dict[str, Any] = {}
    for r in range(args.rounds):
        order = ("direct", "durable") if r % 2 == 0 else ("durable", "direct")
        for side in order:
            if side == "direct":
                drive = direct_steps if args.direct == "steps" else direct
                seconds, reference = await drive(engine, args)
                direct_s.append(seconds)
            else:
                log = workdir / "runner.log"
                seconds, contexts, stored = await durable(engine, url, args, r, log)
                durable_s.append(seconds)
        if contexts != reference:
            raise SystemExit("the durable episodes' contexts differ from the direct ones'")
    ratios = [d / s for d, s in zip(direct_s, durable_s, strict=True)]
    turns, calls = stored["turns"], stored["calls"]
    episodes = args.episodes
    return {
        "workload": {
            "episodes": episodes,
            "turns": args.turns,
            "observation_tokens": args.observation,
            "vocab": args.vocab,
            "token_ms": args.token_ms,
            "runners": args.runners,
            "rounds": args.rounds,
            "engine": "synthetic",
            "direct": args.direct,
        },
        "ratio": round(statistics.median(ratios), 4),
        "ratios": [round(x, 4) for x in ratios],
        "direct_s": [round(x, 3) for x in direct_s],
        "durable_s": [round(x, 3) for x in durable_s],
        "tokens_per_turn": round(
            float(np.mean([len(c) for c in reference]) - (args.turns - 1) * args.observation)
            / args.turns,
            1,
        ),
        "seconds_per_turn_direct": round(statistics.median(direct_s) / args.turns, 4),
        "seconds_per_turn_durable": round(statistics.median(durable_s) / args.turns, 4),
        "added_ms_per_turn": round(
            1000 * (statistics.median(durable_s) - statistics.median(direct_s)) / args.turns, 2
        ),
        "redis_bytes_per_turn": round(stored["all"] / turns, 1),
        "redis_bytes_per_tool_call": round(stored["call"] / calls, 1),
        "observation_bytes_ratio": round(stored["result"] / (4 * stored["observation_tokens"]), 4),
        "episodes_checked": episodes,
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--turns", type=int, default=16)
    ap.add_argument("--observation", type=int, default=128, help="tokens per observation")
    ap.add_argument("--vocab", type=int, default=64, help="turns average vocab/2 tokens")
    ap.add_argument("--token-ms", type=float, default=10.0, help="engine step time")
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--runners", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--runner", choices=("process", "inline"), default="process",
                    help="process: `rollouts env` in a process of its own, as deployed; inline: "
                    "--runners loops on EnvironmentClient in the bench's own process")  # fmt: skip
    ap.add_argument("--direct", choices=("generate", "steps"), default="generate",
                    help="generate: each direct turn a stream of its own; steps: the engine's "
                    "whole steps, as the worker drives it")  # fmt: skip
    ap.add_argument("--json", action="store_true")
    return ap.parse_args(argv)


if __name__ == "__main__":
    arguments = parse()
    figures = asyncio.run(main(arguments))
    print(json.dumps(figures) if arguments.json else json.dumps(figures, indent=2))
    sys.exit(0)
