"""Worker subprocesses and direct-engine references for the worker tests."""

from __future__ import annotations

import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from statemachine import Aborted, Event, Failed, Finished, Resumed, Started
from workers.engines.base import EngineRequest
from workers.engines.cpu import CpuEngine


def start_worker(
    url: str, model: Path, name: str, log: Path, *extra: str, concurrency: int = 2
) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        "-m",
        "workers.cli",
        "worker",
        "--redis",
        url,
        "--engine",
        "cpu",
        "--model",
        str(model),
        "--max-concurrency",
        str(concurrency),
        "--name",
        name,
        "--checkpoint-tokens",
        "8",
        *extra,
    ]
    return subprocess.Popen(cmd, stdout=log.open("ab"), stderr=subprocess.STDOUT)


def attempt_intervals(events_by_rollout: dict[str, list[Event]]) -> dict[str, list[tuple]]:
    """worker -> [(start time, end time, rollout)] of every attempt, from the recorded events."""
    out: dict[str, list[tuple]] = defaultdict(list)
    for rid, events in events_by_rollout.items():
        open_ = None
        for e in events:
            if isinstance(e, Started | Resumed):
                open_ = (e.worker_id, e.at)
            elif isinstance(e, Finished | Aborted | Failed) and open_ is not None:
                out[open_[0]].append((open_[1], e.at, rid))
                open_ = None
    return out


def max_overlap(intervals: list[tuple]) -> int:
    points = sorted(
        [(s, 1) for s, _, _ in intervals] + [(e, -1) for _, e, _ in intervals],
        key=lambda p: (p[0], p[1]),
    )  # ends before starts at the same instant
    level = peak = 0
    for _, step in points:
        level += step
        peak = max(peak, level)
    return peak


async def direct_greedy(model: Path, prompts: list[tuple[int, ...]], sampling) -> list:  # type: ignore[no-untyped-def]
    """What the same engine generates for each prompt, uninterrupted and alone."""
    engine = CpuEngine(model)
    try:
        out = []
        for i, prompt in enumerate(prompts):
            chunks = [
                c
                async for c in engine.generate(
                    EngineRequest(request_id=f"ref{i}", prompt_token_ids=prompt, sampling=sampling)
                )
            ]
            out.append(
                (
                    np.concatenate([c.token_ids for c in chunks]),
                    np.concatenate([c.logprobs for c in chunks]),
                )
            )
        return out
    finally:
        await engine.close()
