"""The CPU engine's channel to its core process (``cpu.process``), apart from the front end
(``cpu.engine``): starting the process with its two pipes, turning the messages a read brings
back into ``Step``s, and handing results to the event loops that asked for them (from the
reader thread, one wake-up per loop)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from statemachine.arrays import unpack_array
from statemachine.status import FinishReason
from workers.engines.base import Chunk, End, Step
from workers.engines.cpu.wire import FrameReader
from workers.engines.errors import (
    EngineClosed,
    EngineError,
    RequestAborted,
    RequestRejected,
    WeightLoadError,
)

# The core's error names, as the front end raises them.
ERRORS: dict[str, type[EngineError]] = {
    "EngineError": EngineError,
    "EngineClosed": EngineClosed,
    "RequestRejected": RequestRejected,
    "WeightLoadError": WeightLoadError,
}
# Importing torch and transformers and loading a model takes 5-10 s on a small machine; a
# core that has not said "ready" long after that is stuck.
START_TIMEOUT_S = 300.0
PROJECT_ROOT = str(Path(__file__).resolve().parents[3])

Post = Callable[..., None]


def spawn_core(
    model_dir: str | Path, weight_version: int, threads: int
) -> tuple[subprocess.Popen[bytes], int, int]:
    """Start the core process; return it and this side's ends of its two pipes."""
    to_core_r, to_core_w = os.pipe()
    from_core_r, from_core_w = os.pipe()
    env = dict(os.environ)
    # The core imports this package: make that work from a source checkout as well.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PROJECT_ROOT, env.get("PYTHONPATH")) if p)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "workers.engines.cpu.process", "--model", str(model_dir),
             "--weight-version", str(weight_version), "--threads", str(threads),
             "--in-fd", str(to_core_r), "--out-fd", str(from_core_w)],
            pass_fds=(to_core_r, from_core_w),
            stdin=subprocess.DEVNULL,
            env=env,
        )  # fmt: skip
    except BaseException:
        for fd in (to_core_r, to_core_w, from_core_r, from_core_w):
            os.close(fd)
        raise
    # Only the child holds these now: its exit closes them, which is how each side notices
    # the other is gone (EOF, EPIPE).
    os.close(to_core_r)
    os.close(from_core_w)
    return proc, to_core_w, from_core_r


def handshake(
    reader: FrameReader, proc: subprocess.Popen[bytes], model_dir: str | Path
) -> dict[str, Any]:
    """Wait for the core's "ready" (its pid, vocabulary size and context length), or raise
    what it says is wrong, or that it exited or never answered."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            messages = reader.read(0.5)
        except EOFError:
            messages = []
        if messages:
            kind, *rest = messages[0]
            if kind == "ready":
                return dict(rest[0])
            kind, text = rest
            raise EngineError(f"cannot start the CPU engine on {model_dir!s}: {kind}: {text}")
        code = proc.poll()
        if code is not None:
            raise EngineError(
                f"the CPU engine process for {model_dir!s} exited with code {code} "
                "before it was ready (its stderr says why)"
            )
    raise EngineError(f"the CPU engine for {model_dir!s} was not ready in {START_TIMEOUT_S}s")


# One token of a read: rid, token, logprob, routes, version, top ([ids], [logprobs] or None),
# prompt routes (packed: with the request's first token only; rare, a turn's first token after
# a tool result).
_Part = tuple[str, Any, Any, Any, int, Any, Any]


class StepBuilder:
    """The messages of one read for requests added with ``add``, as ``Step``s: one per decode
    round and weight version (normally one per read), the ends in the last."""

    def __init__(self) -> None:
        self.parts: list[_Part] = []
        self.ends: dict[str, End] = {}

    def take(self, rid: str, message: list[Any]) -> bool:
        """Add a chunk or error message of ``rid``; True if its stream ended with it."""
        if message[0] == "error":
            _, _, error, text = message
            self.ends[rid] = End(error=ERRORS.get(error, EngineError)(text))
            return True
        _, _, token, logprob, routes, finish, stop_reason, version, top, prompt_routes = message
        self.parts.append((rid, token, logprob, routes, version, top, prompt_routes))
        if finish is None:
            return False
        self.ends[rid] = End(finish_reason=FinishReason(finish), stop_reason=stop_reason)
        return True

    def __bool__(self) -> bool:
        return bool(self.parts or self.ends)

    def build(self) -> list[Step]:
        runs: list[list[_Part]] = []
        seen: set[str] = set()
        for part in self.parts:
            # A read may hold several decode rounds: a request appears once per step.
            if not runs or runs[-1][-1][4] != part[4] or part[0] in seen:
                runs.append([])
                seen.clear()
            runs[-1].append(part)
            seen.add(part[0])
        steps = [
            Step(
                request_ids=[p[0] for p in run],
                token_ids=np.array([p[1] for p in run], dtype=np.int32),
                logprobs=np.array([p[2] for p in run], dtype=np.float32),
                routed_experts=(
                    None if run[0][3] is None else np.concatenate([unpack_array(p[3]) for p in run])
                ),
                weight_version=run[0][4],
                **_tops([p[5] for p in run]),
                prompt_routes=_prompt_routes(run),
            )
            for run in runs
        ]
        if not steps:
            return [Step.only_ends(self.ends)]
        steps[-1] = dataclasses.replace(steps[-1], ends=self.ends)
        return steps


def _prompt_routes(run: list[_Part]) -> Any:
    """The prompt routes of a step's requests that have them: those whose first token it
    holds. Only that step: a read may hold several decode rounds of one request, and a
    stepper given them again would save them twice."""
    mine = {p[0]: unpack_array(p[6]) for p in run if p[6] is not None}
    return mine or None


def _tops(tops: list[Any]) -> dict[str, Any]:
    """A step's top-k arrays [T, K] (K the widest asked; narrower rows zero-padded, as
    ``Step`` allows), or nothing when no request of the step asked for them."""
    width = max((len(t[0]) for t in tops if t is not None), default=0)
    if not width:
        return {}
    ids = np.zeros((len(tops), width), dtype=np.int32)
    lps = np.zeros((len(tops), width), dtype=np.float32)
    for i, top in enumerate(tops):
        if top is not None:
            ids[i, : len(top[0])], lps[i, : len(top[1])] = top
    return {"top_token_ids": ids, "top_logprobs": lps}


def chunk_of(message: list[Any]) -> Chunk:
    """The ``Chunk`` of a core's "chunk" message (one token of a ``generate`` stream)."""
    _, _, token, logprob, routes, finish, stop_reason, version, top, prompt_routes = message
    return Chunk(
        token_ids=np.array([token], dtype=np.int32),
        logprobs=np.array([logprob], dtype=np.float32),
        routed_experts=None if routes is None else unpack_array(routes),
        finish_reason=None if finish is None else FinishReason(finish),
        stop_reason=stop_reason,
        weight_version=version,
        top_token_ids=None if top is None else np.array([top[0]], dtype=np.int32),
        top_logprobs=None if top is None else np.array([top[1]], dtype=np.float32),
        prompt_routes=None if prompt_routes is None else unpack_array(prompt_routes),
    )


def still_open(step: Step, is_open: Callable[[str], bool]) -> Step:
    """``step`` without what it holds of requests no longer open (``is_open``), except their
    aborts (``CpuEngine._still_open``). One token per request: the CPU core's steps."""
    if all(map(is_open, step.request_ids)) and all(map(is_open, step.ends)):
        return step
    keep = [i for i, rid in enumerate(step.request_ids) if is_open(rid)]
    ends = {
        rid: end
        for rid, end in step.ends.items()
        if is_open(rid) or isinstance(end.error, RequestAborted)
    }
    rows = np.asarray(keep, dtype=np.intp)

    def kept(a: np.ndarray | None) -> np.ndarray | None:
        return None if a is None else a[rows]

    prompt_routes = step.prompt_routes and {
        rid: rows for rid, rows in step.prompt_routes.items() if is_open(rid)
    }
    return dataclasses.replace(
        step,
        request_ids=[step.request_ids[i] for i in keep],
        token_ids=step.token_ids[rows],
        logprobs=step.logprobs[rows],
        routed_experts=kept(step.routed_experts),
        top_token_ids=kept(step.top_token_ids),
        top_logprobs=kept(step.top_logprobs),
        ends=ends,
        prompt_routes=prompt_routes or None,
    )


def fresh(error: EngineError) -> EngineError:
    """A new exception like `error`: one instance raised in many places grows one traceback."""
    return type(error)(str(error))


def settler(future: asyncio.Future[Any]) -> Post:
    def settle(result: Any) -> None:
        if future.done():
            return  # the awaiting task was cancelled; nobody wants the outcome
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)

    return settle


def post_all(posts: dict[asyncio.AbstractEventLoop, list[tuple[Post, Any]]]) -> None:
    """Run each loop's callbacks on that loop, with one wake-up per loop."""
    for loop, calls in posts.items():
        # RuntimeError: the loop is closed, so whoever waited on this output is gone.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(_run_calls, calls)


def _run_calls(calls: list[tuple[Post, Any]]) -> None:
    for fn, arg in calls:
        fn(arg)
