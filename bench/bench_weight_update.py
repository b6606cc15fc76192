"""An in-flight weight update, timed: publish -> every in-flight rollout generating again.

One worker (CPU engine, tiny MoE, 8 rollouts in flight, greedy). When every rollout has some
tokens, the trainer publishes new weights. Measured from the events and the worker's timings:

- ``abort_persist_s``: aborting all in-flight generations and persisting their partial output;
- ``load_s``: loading the new checkpoint into the engine;
- ``reprefill_s``: from loaded until the last resumed rollout records its first new-version token
  (re-prefill of prompt + partial on the new weights, then one decode step);
- ``resume_s``: publish -> that moment (the sum, plus the notification);
- ``tokens_kept`` / ``tokens_discarded``: tokens generated before the update that survive it /
  that were lost (regenerated) — every token of an aborted rollout is persisted, so nothing is
  regenerated unless a chunk was still in the engine's pipe at the abort.

Baseline, same run: what in-memory frameworks do without a durable prefix — the in-flight
rollouts are thrown away at the update and submitted again from scratch on the new weights:
``baseline_tokens_discarded`` and ``baseline_resume_s`` (publish of the next version -> the last
restarted rollout's first token).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from statemachine import Cancelled, RolloutRequest, SamplingParams, TokensAppended
from store.client import RolloutClient
from store.redis_server import RedisServer
from workers.runner import Cadence
from workers.worker import Worker, WorkerConfig


def requests(n: int, max_tokens: int) -> list[RolloutRequest]:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [
        RolloutRequest(prompt_token_ids=(17 + i, 5, 99, 250 + i), sampling=sampling)
        for i in range(n)
    ]


class Counting:
    """Wraps an engine and counts the tokens it delivers per request id."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.delivered: dict[str, int] = {}

    @property
    def weight_version(self) -> int:
        return int(self.engine.weight_version)

    async def generate(self, request: Any) -> AsyncIterator[Any]:
        async for chunk in self.engine.generate(request):
            rid = request.request_id
            self.delivered[rid] = self.delivered.get(rid, 0) + len(chunk.token_ids)
            yield chunk

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    async def load_weights(self, source: str, version: int) -> None:
        await self.engine.load_weights(source, version)

    async def close(self) -> None:
        await self.engine.close()


async def first_token_at(client: RolloutClient, rid: str, version: int) -> float:
    while True:
        for e in await client.store.events(rid):
            if isinstance(e, TokensAppended) and int(e.weight_versions[0]) == version:
                return e.at
        await asyncio.sleep(0.01)


async def all_have(client: RolloutClient, ids: list[str], n: int) -> list[int]:
    while True:
        counts = [(await client.store.load(r)).num_tokens for r in ids]
        if min(counts) >= n:
            return counts
        await asyncio.sleep(0.01)


async def main(args: argparse.Namespace) -> dict:
    from workers.engines.cpu.engine import CpuEngine
    from workers.tiny_model import make_tiny_checkpoint, make_tiny_model

    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp) / "redis") as server:
        a = make_tiny_model(Path(tmp) / "a", moe=True, seed=0)
        b = make_tiny_checkpoint(Path(tmp) / "b", like=a, seed=1)
        engine = Counting(CpuEngine(a))
        client = RolloutClient(server.url)
        worker = Worker(
            WorkerConfig(
                redis_url=server.url, max_concurrency=args.rollouts, cadence=Cadence(tokens=1)
            ),
            engine,
        )
        run = asyncio.create_task(worker.run())

        # -- durable resume ------------------------------------------------------------------
        ids = await client.submit(requests(args.rollouts, args.max_tokens))
        await all_have(client, ids, args.before)
        published = await client.publish_weights(1, str(b))
        firsts = [await first_token_at(client, rid, 1) for rid in ids]
        resumed_at = max(firsts)
        assert worker.weights is not None
        timing = worker.weights.updates[-1]
        kept = delivered = 0
        for rid in ids:
            state = await client.store.load(rid)
            kept += int((state.weight_versions == 0).sum())
            delivered += engine.delivered.get(f"{rid}#1", 0)  # what attempt 1 produced
        await client.wait(ids, timeout=600)

        # -- baseline: throw in-flight rollouts away and start them again ----------------------
        ids2 = await client.submit(requests(args.rollouts, args.max_tokens))
        counts = await all_have(client, ids2, args.before)
        t_pub = time.time()
        await client.publish_weights(2, str(a))
        fresh = await client.submit(requests(args.rollouts, args.max_tokens))
        for rid in ids2:  # the in-memory way: their tokens are gone; cancel the records too
            s = await client.store.load(rid)
            if not s.terminal:
                await client.store.append(
                    s,
                    Cancelled(
                        rollout_id=rid, seq=s.seq + 1, reason="baseline: restart from scratch"
                    ),
                )
        baseline_resume = max([await first_token_at(client, rid, 2) for rid in fresh]) - t_pub
        await client.wait(fresh, timeout=600)
        worker.request_stop()
        await run
        await engine.close()
        await client.aclose()
    resume_s = resumed_at - published.at
    return {
        "rollouts_in_flight": args.rollouts,
        "tokens_before_update_min": args.before,
        "resume_s": round(resume_s, 3),
        "abort_persist_s": round(timing.stopped_s, 3),
        "load_s": round(timing.load_s, 3),
        "reprefill_s": round(resumed_at - timing.done_at, 3),
        "tokens_kept": kept,
        "tokens_discarded": delivered - kept,
        "baseline_tokens_discarded": sum(counts),
        "baseline_resume_s": round(baseline_resume, 3),
    }


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rollouts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--before", type=int, default=24, help="tokens each has before the update")
    ap.add_argument("--json", action="store_true")
    ns = ap.parse_args()
    out = asyncio.run(main(ns))
    print(json.dumps(out) if ns.json else "\n".join(f"{k:28s} {v}" for k, v in out.items()))
