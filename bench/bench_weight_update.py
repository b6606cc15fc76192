"""An in-flight weight update, timed: publish -> every in-flight rollout generating again.

One worker (CPU engine, tiny MoE, 8 rollouts in flight, greedy), taking the engine's whole
steps as it does by default (``--interface generate``: one stream per rollout). When every
rollout has some tokens, the trainer publishes new weights. Measured from the events and the
worker's timings:

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
sys.path.insert(0, str(Path(__file__).resolve().parent))

from watch import Watch, still_going

from statemachine import RolloutRequest, SamplingParams, TokensAppended
from store import lifecycle
from store.client import RolloutClient
from store.redis_server import RedisServer
from workers.checkpoint import Cadence
from workers.engines.base import Chunk, EngineRequest, Step
from workers.engines.cpu.engine import CpuEngine
from workers.worker import Worker, WorkerConfig


def requests(n: int, max_tokens: int) -> list[RolloutRequest]:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [
        RolloutRequest(prompt_token_ids=(17 + i, 5, 99, 250 + i), sampling=sampling)
        for i in range(n)
    ]


class Counting(CpuEngine):
    """The CPU engine, counting the tokens it delivers per request id, whichever way the worker
    takes them (whole steps or a stream per request). A subclass, not a wrapper: everything
    else the engine protocol asks (``model_id``, ``limits``, what is added to it later) is the
    CPU engine's own, so the benchmark cannot fall behind it (a wrapper without ``model_id``
    killed the worker at start once, and the benchmark waited forever)."""

    def __init__(self, model_dir: str | Path) -> None:
        super().__init__(model_dir)
        self.delivered: dict[str, int] = {}

    async def generate(self, request: EngineRequest) -> AsyncIterator[Chunk]:
        async for chunk in super().generate(request):
            rid = request.request_id
            self.delivered[rid] = self.delivered.get(rid, 0) + len(chunk.token_ids)
            yield chunk

    async def steps(self) -> AsyncIterator[Step]:
        async for step in super().steps():
            counts = [1] * len(step.request_ids) if step.counts is None else step.counts.tolist()
            for rid, n in zip(step.request_ids, counts, strict=True):
                self.delivered[rid] = self.delivered.get(rid, 0) + n
            yield step


async def first_token_at(client: RolloutClient, rid: str, version: int) -> float:
    while True:
        for e in await client.store.events(rid):
            if isinstance(e, TokensAppended) and int(e.weight_versions[0]) == version:
                return e.at
        await still_going(client, rid, f"a token on weights v{version}")
        await asyncio.sleep(0.01)


async def all_have(client: RolloutClient, ids: list[str], n: int) -> list[int]:
    while True:
        counts = [(await client.store.load(r)).num_tokens for r in ids]
        if min(counts) >= n:
            return counts
        for rid, count in zip(ids, counts):
            if count < n:
                await still_going(client, rid, f"{n} tokens (it has {count})")
        await asyncio.sleep(0.01)


async def main(args: argparse.Namespace) -> dict[str, Any]:
    from workers.demo.tiny_model import make_tiny_checkpoint, make_tiny_model

    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp) / "redis") as server:
        a = make_tiny_model(Path(tmp) / "a", moe=True, seed=0)
        b = make_tiny_checkpoint(Path(tmp) / "b", like=a, seed=1)
        engine = Counting(a)
        client = RolloutClient(server.url)
        worker = Worker(
            WorkerConfig(
                redis_url=server.url, max_concurrency=args.rollouts, cadence=Cadence(tokens=1),
                stepped=args.interface == "steps",
            ),
            engine,
        )  # fmt: skip
        try:
            async with Watch() as watch:
                watch.redis(server)
                run = watch.task(asyncio.create_task(worker.run()), "worker")
                figures = await updates(args, client, engine, worker, a, b)
                watch.release(run)
                worker.request_stop()
                await run
        finally:
            await engine.close()
            await client.aclose()
    return {"rollouts_in_flight": args.rollouts, "tokens_before_update_min": args.before,
            "interface": args.interface, **figures}  # fmt: skip


async def updates(
    args: argparse.Namespace, client: RolloutClient, engine: Counting, worker: Worker,
    a: Path, b: Path,
) -> dict[str, Any]:  # fmt: skip
    """The durable resume, then the restart-from-scratch baseline, on the running worker."""
    # -- durable resume ----------------------------------------------------------------------
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

    # -- baseline: throw in-flight rollouts away and start them again --------------------------
    ids2 = await client.submit(requests(args.rollouts, args.max_tokens))
    counts = await all_have(client, ids2, args.before)
    t_pub = time.time()
    await client.publish_weights(2, str(a))
    fresh = await client.submit(requests(args.rollouts, args.max_tokens))
    # The in-memory way: their tokens are gone; cancel the records too, through the trainer's
    # cancel (a hand-made append raced the worker's checkpoints: SequenceConflict under load).
    await lifecycle.cancel(client.store, ids2, "baseline: restart from scratch", refuse_ended=False)
    baseline_resume = max([await first_token_at(client, rid, 2) for rid in fresh]) - t_pub
    await client.wait(fresh, timeout=600)
    resume_s = resumed_at - published.at
    return {
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
    ap.add_argument(
        "--interface", choices=("steps", "generate"), default="steps",
        help="how the worker consumes the engine: whole steps, or a stream per rollout",
    )  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="a tiny workload (the smoke test's)")
    ap.add_argument("--json", action="store_true")
    ns = ap.parse_args()
    if ns.quick:
        ns.rollouts, ns.max_tokens, ns.before = 2, 24, 8
    out = asyncio.run(main(ns))
    print(json.dumps(out) if ns.json else "\n".join(f"{k:28s} {v}" for k, v in out.items()))
