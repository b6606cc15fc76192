"""A stop string that straddles the point where a rollout was resumed still stops it."""

from __future__ import annotations

from pathlib import Path

from statemachine import SamplingParams
from tests.engine_pool import EnginePool
from workers.engines.base import EngineRequest, join_chunks
from workers.engines.cpu.engine import CpuEngine


async def run(
    engine: CpuEngine, rid: str, prompt: tuple[int, ...], resumed: int = 0, **sampling: object
) -> tuple[list[int], object]:
    chunks = [
        c
        async for c in engine.generate(
            EngineRequest(
                request_id=rid,
                prompt_token_ids=prompt,
                resumed_tokens=resumed,
                sampling=SamplingParams(temperature=0.0, ignore_eos=True, **sampling),
            )
        )
    ]
    return join_chunks(chunks).token_ids.tolist(), chunks[-1].stop_reason


async def test_stop_string_straddling_the_resume_point(
    cpu_pool: EnginePool, tiny_dense_dir: Path
) -> None:
    engine = await cpu_pool.get(tiny_dense_dir)
    prompt, n = (11, 22, 33, 44), 40
    ids, _ = await run(engine, "full", prompt, max_tokens=n)
    tok = engine.tokenizer
    text = tok.decode(ids, skip_special_tokens=True)
    found = None
    for k in range(4, n - 4):
        edge = len(tok.decode(ids[:k], skip_special_tokens=True))
        stop = text[edge - 2 : edge + 2]
        if len(stop) == 4 and text.find(stop) == edge - 2 and stop.strip() == stop:
            found = k, stop
            break
    assert found is not None, "no usable straddling stop string in this output"
    k, stop = found
    # Uninterrupted, the stop string ends the rollout at some token m > k ...
    whole, reason = await run(engine, "stop", prompt, max_tokens=n, stop=(stop,))
    assert reason == stop and len(whole) > k
    # ... and resumed at k (the first k tokens are prompt now), it ends at the same token.
    rest, reason = await run(
        engine, "resumed", (*prompt, *ids[:k]), resumed=k, max_tokens=n - k, stop=(stop,)
    )
    assert reason == stop
    assert ids[:k] + rest == whole
    # Without the resume hint the engine could not have seen it (the vLLM blind spot).
    blind, reason = await run(engine, "blind", (*prompt, *ids[:k]), max_tokens=n - k, stop=(stop,))
    assert ids[:k] + blind != whole or reason != stop
