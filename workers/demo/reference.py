"""The demo's check: every greedy rollout equals an uninterrupted run, weight segment by segment.

A rollout whose tokens came from v1 then v2 (``RolloutResult.version_segments``) is compared
with v1's greedy continuation of the prompt up to the split, then v2's greedy continuation of
prompt + that prefix: what an uninterrupted generation would give if the weights changed at the
same token. Kills and aborts within one version are invisible to this reference, so any token a
resume got wrong shows up as a mismatch.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from statemachine import SamplingParams, Status
from store.results import RolloutResult

# Generations the in-process engine is given at once (it batches them).
CONCURRENCY = 16


@dataclass(frozen=True, slots=True)
class Mismatch:
    rollout_id: str
    version: int
    start: int
    expected: list[int]
    got: list[int]
    problem: str = ""

    def describe(self) -> str:
        if self.problem:
            return f"{self.rollout_id}: {self.problem}"
        first = next(
            (i for i, (a, b) in enumerate(zip(self.expected, self.got, strict=False)) if a != b),
            min(len(self.expected), len(self.got)),
        )
        return (
            f"{self.rollout_id}: tokens {self.start}.. on weights v{self.version} differ from "
            f"the uninterrupted run at token {self.start + first}: "
            f"expected {self.expected[first : first + 5]}, got {self.got[first : first + 5]}"
        )


# (prompt + prefix, version, tokens): one reference generation, shared by identical samples.
Key = tuple[tuple[int, ...], int, int]


async def check(
    model: Path, weights: dict[int, Path], results: list[RolloutResult]
) -> tuple[int, list[Mismatch]]:
    """Compare every rollout's segments (the demo samples greedily); returns (segments
    checked, mismatches). A rollout that did not finish counts as a mismatch too."""
    from workers.engines.cpu.engine import CpuEngine  # noqa: PLC0415  (torch: on demand)

    wanted: dict[int, set[Key]] = defaultdict(set)
    todo: list[tuple[RolloutResult, int, int, int, Key]] = []
    unfinished = []
    for r in results:
        if r.status is not Status.DONE:
            unfinished.append(Mismatch(r.rollout_id, -1, 0, [], [], f"ended {r.status.value}"))
            continue
        ids = r.response_token_ids.tolist()
        for version, start, end in r.version_segments:
            key = ((*r.prompt_token_ids, *ids[:start]), version, end - start)
            wanted[version].add(key)
            todo.append((r, version, start, end, key))
    engine = CpuEngine(model)
    reference: dict[Key, list[int]] = {}
    try:
        for version in sorted(wanted):
            await engine.load_weights(str(weights[version]), version)
            keys = sorted(wanted[version])
            for i in range(0, len(keys), CONCURRENCY):
                part = keys[i : i + CONCURRENCY]
                outs = await asyncio.gather(
                    *(_greedy(engine, k, f"ref-{version}-{i + j}") for j, k in enumerate(part))
                )
                reference.update(zip(part, outs, strict=True))
    finally:
        await engine.close()
    mismatches = unfinished
    for r, version, start, end, key in todo:
        got = r.response_token_ids[start:end].tolist()
        if got != reference[key]:
            mismatches.append(Mismatch(r.rollout_id, version, start, reference[key], got))
    return len(todo), mismatches


async def _greedy(engine: object, key: Key, request_id: str) -> list[int]:
    from workers.engines.base import EngineRequest, join_chunks  # noqa: PLC0415

    prompt, _version, n = key
    request = EngineRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling=SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
    )
    chunks = [c async for c in engine.generate(request)]  # type: ignore[attr-defined]
    return list(np.asarray(join_chunks(chunks).token_ids).tolist())
