"""The baseline for bench_recovery.py: a plain rq job that generates a rollout in one go, the
way an in-memory framework would, recording only how far it got (to count lost tokens)."""

from __future__ import annotations

import asyncio
import os

from redis import Redis

from statemachine import SamplingParams
from workers.engines.base import EngineRequest
from workers.engines.cpu.engine import CpuEngine

PROGRESS = "rqbench:progress"  # hash: execution number -> tokens generated so far


def generate(model: str, prompt: list[int], max_tokens: int) -> int:
    redis = Redis.from_url(os.environ["RQBENCH_REDIS"])
    execution = redis.hincrby(PROGRESS, "executions", 1)

    async def run() -> int:
        engine = CpuEngine(model)
        n = 0
        try:
            sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            async for chunk in engine.generate(
                EngineRequest(request_id="rq", prompt_token_ids=tuple(prompt), sampling=sampling)
            ):
                n += len(chunk.token_ids)
                redis.hset(PROGRESS, str(execution), n)
        finally:
            await engine.close()
        return n

    return asyncio.run(run())
