"""A deterministic toy tool for episodes of the tiny random-weight model (``rollouts
make-tiny-model``), served by ``rollouts env --tools examples.calculator:calculator``.

The model "calls" it with the tokens it sampled in the turn (``{"token_ids": [...]}``, what a
worker records without a parser); it answers 4 observation token ids that depend only on
them (the digits of their sum, as ids 10-19, valid in any tiny model's vocabulary) and the
environment revision ``rev-<n>``, n counting the episode's calls (one more than the revision
it was given). A submitter declares it with ``TOOLS`` (or ``episode_spec``).

It counts its own executions, to prove what ran twice and what did not: with
``$CALCULATOR_LOG`` naming a file, each execution appends ``<idempotency_key> <restore> <pid>
<env_revision or ->`` there, synced to disk, before anything else: that line is the call's
effect. ``$CALCULATOR_SLEEP_S`` makes it wait that long after the effect and before returning,
the window in which a runner killed leaves a call whose effect happened with no result
recorded (effect unverified), as the tests do.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

from statemachine.episode import EpisodeSpec, ToolEffect, ToolSpec
from workers.env import Call, ToolFatal, ToolOutput

NAME = "calculator"
LOG_ENV = "CALCULATOR_LOG"
SLEEP_ENV = "CALCULATOR_SLEEP_S"
# Running it twice gives the same observation: recovery may run it again.
TOOLS = [ToolSpec(name=NAME, effect=ToolEffect.IDEMPOTENT)]


def episode_spec(
    stop_token_ids: Sequence[int],
    *,
    effect: ToolEffect | str = ToolEffect.IDEMPOTENT,
    **budgets: Any,
) -> EpisodeSpec:
    """The episode a submitter asks for: turns end at one of ``stop_token_ids`` with a call
    of the calculator, declared ``effect`` (the tests declare it ``restore`` and ``restart``
    too); ``budgets`` are EpisodeSpec's (``max_turns=3``, ...)."""
    return EpisodeSpec(
        tool_call_stop_token_ids=tuple(stop_token_ids),
        tools=(ToolSpec(name=NAME, effect=ToolEffect(effect)),),
        **budgets,
    )


def observation(token_ids: Sequence[int]) -> list[int]:
    """The 4 observation ids for a turn's ``token_ids``: the digits of their sum (mod 10^4,
    zero-padded) as ids 10-19."""
    return [10 + int(d) for d in f"{sum(token_ids) % 10_000:04d}"]


def revision_after(env_revision: str) -> str:
    """``rev-<n+1>`` after ``rev-<n>``; ``rev-1`` for the first call ("")."""
    if not env_revision:
        return "rev-1"
    prefix, _, n = env_revision.partition("-")
    if prefix != "rev" or not n.isdigit():
        raise ToolFatal(f"not a calculator revision: {env_revision!r}")
    return f"rev-{int(n) + 1}"


def calculator(call: Call) -> ToolOutput:
    args = call.args
    ids = args.get("token_ids") if isinstance(args, dict) else None
    if not isinstance(ids, list) or not all(type(t) is int for t in ids):
        raise ToolFatal(f'calculator wants {{"token_ids": [int, ...]}}, got {call.arguments!r}')
    revision = revision_after(call.env_revision)
    _count(call)
    pause = os.environ.get(SLEEP_ENV)
    if pause:
        time.sleep(float(pause))
    return ToolOutput(observation(ids), env_handle=NAME, env_revision=revision)


def _count(call: Call) -> None:
    path = os.environ.get(LOG_ENV)
    if not path:
        return
    line = f"{call.idempotency_key} {call.restore} {os.getpid()} {call.env_revision or '-'}\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())  # one write, O_APPEND: whole lines even from two runners
        os.fsync(fd)  # on disk before the call can return: a kill after it still counts
    finally:
        os.close(fd)
