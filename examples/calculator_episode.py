"""A 3-turn episode end to end on the CPU engine, with a worker and an environment runner
killed on the way: ``python -m examples.calculator_episode`` (``--json`` for one object).

It starts its own redis-server in a temporary directory, builds a tiny random-weight MoE model
whose turns end at its tool-call token after 24 tokens (``rollouts make-tiny-model
--tool-turn 24``), and starts a worker (``rollouts worker``) and an environment runner
(``rollouts env --tools examples.calculator:calculator``). It submits one episode of 3 turns
and then:

- SIGKILLs the worker while turn 2 generates (a replacement resumes the turn from its last
  checkpoint);
- SIGKILLs the runner while the calculator runs turn 2's call: its effect is done (its log
  says so), no result is recorded. Another runner finds the call's lease lapsed, and the
  calculator being ``idempotent``, runs it again.

At the end it checks the episode token for token against the same episode run on the engine
alone, uninterrupted, and prints its turns, its calls (each claim, how it ended, what recovery
decided) and the calculator's own log of its executions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from examples.calculator import LOG_ENV, SLEEP_ENV, episode_spec, observation
from statemachine import RolloutRequest, RolloutState, SamplingParams, Status
from store.client import RolloutClient
from store.redis_server import RedisServer
from store.results import RolloutResult
from workers.engines.base import Engine, EngineRequest, join_chunks
from workers.env.cli import command as env_command
from workers.worker_cli import command as worker_command

TURN = 24  # tokens per turn of the tool-turn model
TURNS = 3
PROMPT = (5, 17, 300, 44, 9)
FAST = ("--lease-ttl", "2", "--heartbeat", "0.25", "--checkpoint-tokens", "8")


def request(stop: int) -> RolloutRequest:
    return RolloutRequest(
        prompt_token_ids=PROMPT,
        sampling=SamplingParams(max_tokens=200, temperature=0.0),
        episode=episode_spec([stop], max_turns=TURNS),
    )


async def direct_episode(
    engine: Engine,
    req: RolloutRequest,
    turns: int,
    tool: Callable[[list[int]], list[int]] = observation,
) -> tuple[list[int], list[int]]:
    """The episode on ``engine`` alone, uninterrupted: each turn's prompt is the whole context
    so far and it ends at the first tool-call stop; the tool's observation follows (the last
    turn's call ends the episode at ``max_turns``). The context after the prompt, and its
    loss mask."""
    assert req.episode is not None
    stops = req.episode.tool_call_stop_token_ids
    context: list[int] = []
    mask: list[int] = []
    for turn in range(turns):
        sampling = replace(
            req.sampling,
            max_tokens=req.sampling.max_tokens - sum(mask),
            stop_token_ids=req.sampling.stop_token_ids + stops,
        )
        stream = engine.generate(
            EngineRequest(
                request_id=f"direct-{id(context)}-{turn}",
                prompt_token_ids=req.prompt_token_ids + tuple(context),
                sampling=sampling,
            )
        )
        ids = join_chunks([c async for c in stream]).token_ids.tolist()
        context += ids
        mask += [1] * len(ids)
        if ids[-1] not in stops or turn == turns - 1:
            break
        obs = tool(ids)
        context += obs
        mask += [0] * len(obs)
    return context, mask


async def _until(cond: Callable[[], Awaitable[bool]], what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not await cond():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        await asyncio.sleep(0.005)


def _stop(*procs: subprocess.Popen[bytes]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


class _Processes:
    """The processes the example starts, each logging to a file of its own."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: list[subprocess.Popen[bytes]] = []

    def spawn(self, cmd: list[str], name: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
        out = (self.logs / f"{name}.log").open("ab")
        p = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT)
        self.procs.append(p)
        return p

    def worker(self, url: str, model: Path, name: str) -> subprocess.Popen[bytes]:
        return self.spawn(worker_command(url, model, name, *FAST, concurrency=1), name, {})

    def runner(self, url: str, name: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
        return self.spawn(env_command(url, "--lease-s", "2", "--runner-id", name), name, env)


async def _episode(
    url: str, model: Path, stop: int, procs: _Processes, calc_log: Path
) -> tuple[RolloutResult, RolloutState, int]:
    """Run the episode with its two kills; (its result, its state, the token it was killed at)."""
    worker = procs.worker(url, model, "worker-a")
    fast = {LOG_ENV: str(calc_log)}
    runner = procs.runner(url, "env-a", fast)
    client = RolloutClient(url)
    [rid] = await client.submit([request(stop)])

    async def turn_2_generating() -> bool:
        s = await client.store.load(rid)
        live = s.status in (Status.GENERATING, Status.RESUMED)
        return live and len(s.calls) == 1 and s.num_tokens - s.calls[0].offset >= 8

    await _until(turn_2_generating, "turn 2 never got going")
    worker.kill()  # SIGKILL mid-turn
    worker.wait(10)
    killed_at = (await client.store.load(rid)).num_tokens
    procs.worker(url, model, "worker-b")
    # The runner of the next call is one whose calculator hangs after its effect.
    _stop(runner)
    runner = procs.runner(url, "env-b", {**fast, SLEEP_ENV: "30"})

    async def call_2_done_not_recorded() -> bool:
        s = await client.store.load(rid)
        effects = calc_log.read_text().count("\n") if calc_log.exists() else 0
        return s.status is Status.RUNNING_TOOL and len(s.calls) == 2 and effects == 2

    await _until(call_2_done_not_recorded, "the second call never ran")
    runner.send_signal(signal.SIGKILL)  # its effect happened; no result recorded
    runner.wait(10)
    procs.runner(url, "env-c", fast)
    [result] = await client.wait([rid], timeout=180)
    final = await client.store.load(rid)
    await client.aclose()
    return result, final, killed_at


async def run(workdir: Path) -> dict[str, Any]:
    from workers.demo.tiny_model import make_tiny_model, tool_call_token  # noqa: PLC0415
    from workers.engines.cpu.engine import CpuEngine  # noqa: PLC0415

    (workdir / "logs").mkdir()
    procs = _Processes(workdir / "logs")
    calc_log = workdir / "calculator.log"
    model = make_tiny_model(workdir / "model", moe=True, tool_turn=TURN)
    stop = tool_call_token(TURN)
    server = RedisServer(workdir / "redis")
    server.start()
    try:
        result, final, killed_at = await _episode(server.url, model, stop, procs, calc_log)
    finally:
        _stop(*procs.procs)
        server.close()
    engine = CpuEngine(model)
    try:
        context, mask = await direct_episode(engine, request(stop), TURNS)
    finally:
        await engine.close()
    return _report(final, result.status, context, mask, killed_at, calc_log.read_text())


def _report(
    s: RolloutState, status: Status, context: list[int], mask: list[int], killed_at: int, log: str
) -> dict[str, Any]:
    versions = s.context_weight_versions.tolist()
    turns = [{"tokens": [a, b], "weight_versions": sorted(set(versions[a:b]))} for a, b in s.turns]
    calls = [
        {
            "call_id": c.call_id,
            "name": c.name,
            "observation": [] if c.result is None else c.result.observation_token_ids.tolist(),
            "claims": [
                {
                    "runner": k.runner_id,
                    "ended": None if k.end is None else k.end.value,
                    "decision": None if k.decision is None else k.decision.value,
                }
                for k in c.claims
            ],
        }
        for c in s.calls
    ]
    executions = [line.split()[0] for line in log.splitlines()]
    return {
        "rollout_id": s.rollout_id,
        "status": status.value,
        "finish_reason": None if s.finish_reason is None else s.finish_reason.value,
        "turns": turns,
        "calls": calls,
        "context_tokens": len(s.context_token_ids),
        "sampled_tokens": int(s.loss_mask.sum()),
        "worker_killed_at_token": killed_at,
        "calculator_executions": {k: executions.count(k) for k in dict.fromkeys(executions)},
        "equals_uninterrupted": s.context_token_ids.tolist() == context
        and s.loss_mask.tolist() == mask,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the report as one JSON object")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="calculator-episode-") as tmp:
        report = asyncio.run(run(Path(tmp)))
    if args.json:
        print(json.dumps(report))
    else:
        r = report
        print(f"episode {r['rollout_id']}: {r['status']} ({r['finish_reason']}), "
              f"{r['context_tokens']} context tokens, {r['sampled_tokens']} sampled")  # fmt: skip
        for i, t in enumerate(report["turns"], 1):
            print(f"  turn {i}: tokens {t['tokens'][0]}..{t['tokens'][1]}, "
                  f"weights {t['weight_versions']}")  # fmt: skip
        for c in report["calls"]:
            claims = ", ".join(
                f"{k['runner']}: {k['ended'] or 'running'}"
                + (f" (effect unverified: {k['decision']})" if k["decision"] else "")
                for k in c["claims"]
            )
            print(f"  {c['call_id']} {c['name']} -> {c['observation'] or 'none (budget)'}; "
                  f"claims: {claims or 'none'}")  # fmt: skip
        print(f"  worker SIGKILLed in turn 2 at token {report['worker_killed_at_token']}; "
              f"calculator executions: {report['calculator_executions']}")  # fmt: skip
        print("equals the uninterrupted episode" if report["equals_uninterrupted"]
              else "DIFFERS from the uninterrupted episode")  # fmt: skip
    return 0 if report["equals_uninterrupted"] and report["status"] == "done" else 1


if __name__ == "__main__":
    sys.exit(main())
