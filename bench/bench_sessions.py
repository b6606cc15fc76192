"""What a harness's session stores in Redis, side by side in one run: its calls as the turns of
one episode (``store.harness_turns``: each call records the tokens its prompt adds) against the
same calls as a rollout each (each recording its whole prompt: how sessions were stored before,
and how a call of ``n`` > 1 samples still is).

The workload: ``--sessions`` sessions of ``--turns`` calls each. A call's prompt is a system
prompt of ``--system`` tokens, then per earlier call its answer (``--answer`` tokens, greedy on
the synthetic engine) and a tool result of ``--tool`` tokens, as a harness appends them; both
sides get the very same prompts (checked) and run on one real worker (in-process, synthetic
engine) over a real redis-server with AOF. Bytes: every key of the session's rollouts (their
logs, snapshots, batch records, completion streams) by ``MEMORY USAGE``, and the log records
alone (the values Redis holds, what grows with the prompts).

``python bench/bench_sessions.py --json`` prints one object: ``bytes_ratio`` (episode over
rollout-per-call, all keys) and ``log_bytes_ratio`` (log records only), beside the bytes of
each side per session.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from statemachine import RolloutRequest, SamplingParams
from store.client import RolloutClient
from store.harness_turns import HarnessTurns
from store.redis_server import RedisServer
from store.results import RolloutResult
from store.turn_results import turn_result
from workers.engines.synthetic import SyntheticEngine
from workers.worker import Worker, WorkerConfig

WORKLOAD = ("sessions", "turns", "system", "answer", "tool")


def system_prompt(n: int, session: int) -> tuple[int, ...]:
    return tuple(100 + (7 * session + j) % 20_000 for j in range(n))


def tool_result(k: int, n: int) -> tuple[int, ...]:
    return tuple(30_000 + (k * 13 + j) % 1_000 for j in range(n))


async def as_episode(client: RolloutClient, args: argparse.Namespace, s: int) -> list[Any]:
    """The session's calls through ``HarnessTurns``: (prompt, answer) per call, and the ids."""
    turns = HarnessTurns(client)
    sampling = SamplingParams(max_tokens=args.answer, temperature=0.0, ignore_eos=True)
    prompt, calls = system_prompt(args.system, s), []
    for k in range(args.turns):
        request = RolloutRequest(prompt_token_ids=prompt, sampling=sampling)
        turn = await turns.begin(f"s{s}", f"s{s}-call-{k}", request)
        state = await turns.wait(turn, timeout=120)
        answer = turn_result(RolloutResult.from_state(state), turn.turn, turn.batch_id)
        calls.append((prompt, answer.response_token_ids.tolist(), turn.rollout_id))
        prompt = (*prompt, *calls[-1][1], *tool_result(k, args.tool))
    return calls


async def as_rollouts(client: RolloutClient, prompts: list[tuple[int, ...]],
                      args: argparse.Namespace) -> list[Any]:  # fmt: skip
    """The same prompts, a rollout each (as every session's call was recorded before)."""
    sampling = SamplingParams(max_tokens=args.answer, temperature=0.0, ignore_eos=True)
    out = []
    for prompt in prompts:
        batch = await client.submit([RolloutRequest(prompt_token_ids=prompt, sampling=sampling)])
        [result] = await client.wait(batch, timeout=120)
        out.append((prompt, result.response_token_ids.tolist(), result.rollout_id))
    return out


async def stored(client: RolloutClient, ids: set[str]) -> dict[str, int]:
    """Bytes Redis holds for rollouts ``ids``: every key of theirs, and their log records."""
    keys: set[str] = set()
    log = 0
    for rid in ids:
        keys |= {client.keys.log(rid), client.keys.snapshot(rid)}
        state = await client.store.head(rid)
        batch = state.membership.batch_id
        keys |= {client.keys.batch(batch), client.keys.completions(batch)}
        for _, fields in await client.redis.xrange(client.keys.log(rid)):
            log += len(fields[b"e"])
    memory = 0
    for key in keys:
        memory += int(await client.redis.memory_usage(key) or 0)
    return {"memory": memory, "log": log}


async def main(args: argparse.Namespace) -> dict[str, Any]:
    with (
        tempfile.TemporaryDirectory(prefix="bench-sessions-") as tmp,
        RedisServer(Path(tmp)) as server,
    ):
        client = RolloutClient(server.url)
        engine = SyntheticEngine(tokens_per_chunk=16)
        worker = Worker(WorkerConfig(redis_url=server.url, max_concurrency=4), engine)
        running = asyncio.create_task(worker.run())
        try:
            episode, plain = await measure(client, args)
        finally:
            worker.request_stop()
            await running
            await client.aclose()
    per = args.sessions
    return {
        "workload": {
            k: getattr(args, k) for k in ("sessions", "turns", "system", "answer", "tool")
        },
        "bytes_ratio": round(episode["memory"] / plain["memory"], 4),
        "log_bytes_ratio": round(episode["log"] / plain["log"], 4),
        "episode_bytes_per_session": episode["memory"] // per,
        "rollouts_bytes_per_session": plain["memory"] // per,
        "episode_log_bytes_per_session": episode["log"] // per,
        "rollouts_log_bytes_per_session": plain["log"] // per,
    }


async def measure(
    client: RolloutClient, args: argparse.Namespace
) -> tuple[dict[str, int], dict[str, int]]:
    """The bytes of both sides, summed over the sessions."""
    episode, plain = {"memory": 0, "log": 0}, {"memory": 0, "log": 0}
    for s in range(args.sessions):
        calls = await as_episode(client, args, s)
        again = await as_rollouts(client, [p for p, _, _ in calls], args)
        if [a for _, a, _ in calls] != [a for _, a, _ in again]:
            raise SystemExit("the two sides' answers differ")
        for side, got in ((episode, calls), (plain, again)):
            for name, n in (await stored(client, {r for *_, r in got})).items():
                side[name] += n
    return episode, plain


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--turns", type=int, default=16)
    ap.add_argument("--system", type=int, default=1024, help="tokens of the system prompt")
    ap.add_argument("--answer", type=int, default=256, help="tokens of each answer")
    ap.add_argument("--tool", type=int, default=128, help="tokens of each tool result")
    ap.add_argument("--json", action="store_true")
    return ap.parse_args(argv)


if __name__ == "__main__":
    arguments = parse()
    figures = asyncio.run(main(arguments))
    print(json.dumps(figures) if arguments.json else json.dumps(figures, indent=2))
    sys.exit(0)
