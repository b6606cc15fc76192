"""vllm-http against real vLLM server processes on 127.0.0.1 (beyond the shared contract):
a server SIGKILLed mid-request is marked unhealthy and the generation resumes on the other
server with exactly the uninterrupted greedy tokens."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from statemachine.request import SamplingParams
from tests.engines.stream import collect_request
from tests.engines.vllm_servers import MAX_MODEL_LEN, TEST_HTTP, VllmServer
from workers.engines.base import EngineRequest
from workers.engines.vllm.http import VllmHttpEngine

pytestmark = [pytest.mark.vllm, pytest.mark.vllm_server, pytest.mark.asyncio(loop_scope="session")]

# Long enough that the victim cannot finish between its first chunk and being frozen, even
# on 2 loaded cores (160 tokens could: the whole answer sat in the socket before the kill).
N = 400


def greedy(rid: str, prompt: tuple[int, ...], n: int = N) -> EngineRequest:
    return EngineRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling=SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
    )


async def test_server_killed_mid_request_resumes_on_another(
    vllm_server_pool, vllm_env: Path, tiny_moe_dir: Path
) -> None:
    survivor = await vllm_server_pool.server(tiny_moe_dir)
    # A second server on the same model, ours to kill (the pooled one stays usable).
    victim = VllmServer(tiny_moe_dir, vllm_env).start()
    try:
        await victim.wait_healthy()
        prompt = (11, 402, 97, 1203, 7)
        reference = VllmHttpEngine([survivor.url], model_dir=tiny_moe_dir, options=TEST_HTTP)
        # The survivor may hold other weights after earlier tests: its own ones back first.
        await reference.load_weights(str(tiny_moe_dir), 0)
        expected = await collect_request(reference, greedy("ref", prompt))
        await reference.aclose()

        engine = VllmHttpEngine(
            [victim.url, survivor.url],
            model_dir=tiny_moe_dir,
            options=TEST_HTTP,
            max_model_len=MAX_MODEL_LEN,
        )
        try:
            stream = engine.generate(greedy("r", prompt))
            chunks = [await anext(stream)]  # both idle: the first listed (victim) serves it
            victim.freeze()  # mid-request, whatever the load: it generates nothing more
            assert engine.pool.servers[0].in_flight == 1
            await asyncio.to_thread(victim.kill)
            chunks += [c async for c in stream]
            got = [int(t) for c in chunks for t in c.token_ids]
            assert got == expected.token_ids  # resumed on the survivor, exactly
            assert not engine.pool.servers[0].healthy  # the dead one is marked
            assert engine.pool.servers[1].healthy
            # Later requests go to the survivor without waiting for the dead one.
            again = await collect_request(engine, greedy("again", prompt, 8))
            assert again.token_ids == expected.token_ids[:8]
        finally:
            await engine.aclose()
    finally:
        await asyncio.to_thread(victim.stop)
