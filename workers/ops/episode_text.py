"""How ``rollouts show`` draws an episode: its tool events in the timeline, then its turns and
tool calls as the trainer's result has them (``store.episode_results``), and how it ended. A
plain rollout gets none of this. No I/O besides building strings."""

from __future__ import annotations

from typing import Any

import numpy as np

from statemachine import HARNESS_CALL, RolloutState, Status, harness_commands
from store.episode_results import EpisodeCall, EpisodeClaim
from store.results import RolloutResult
from store.timeline import Entry

ARGUMENTS_SHOWN = 60  # characters of a call's arguments in the text (--json has them whole)
# What recovery did about a lost claim, by the tool's declared effect.
DECISIONS = {
    "idempotent": "run again",
    "restore": "the last result's revision restored, then run again",
    "restart": "the episode failed (effect_unverified)",
}


def describe(e: Entry) -> str | None:
    """A timeline line for an episode's tool event, None for any other entry."""
    if e.kind == "tool_requested":
        return (f"attempt {e.attempt}'s turn ended at call {e.call_id}: {e.reason} "
                f"{_short(e.detail)} ({e.tokens} tokens sampled so far)")  # fmt: skip
    if e.kind == "tool_claimed":
        return f"call {e.call_id} claim {e.claim} taken by runner {e.runner_id}"
    if e.kind == "tool_result":
        return f"call {e.call_id} claim {e.claim}: result, {e.tokens} observation tokens"
    if e.kind == "tool_failed":
        return f"call {e.call_id} claim {e.claim} failed ({e.reason}): {e.detail}"
    if e.kind == "tool_lost":
        why = f" ({e.detail})" if e.detail else ""
        return (f"call {e.call_id} claim {e.claim} lost{why}, effect unverified: "
                f"{DECISIONS.get(e.reason, e.reason)}")  # fmt: skip
    return None


def section(state: RolloutState) -> list[str]:
    """The episode's turns, each with the call that ended it, and how the episode ended."""
    r = RolloutResult.from_state(state)
    calls = r.tool_calls or ()
    turns = r.turns or ()
    fed = state.observation_tokens
    lines = [
        f"episode: {len(turns)} turn{_s(len(turns))}, {len(calls)} tool call{_s(len(calls))}; "
        f"context {len(r.response_token_ids)} tokens ({state.num_tokens} sampled, {fed} "
        f"observation); {_ending(state)}"
    ]
    for i, (start, end) in enumerate(turns):
        versions = _by_version(r.weight_versions[start:end])
        shown = ", ".join(f"v{v}: {n}" for v, n in versions.items())
        lines.append(f"  turn {i}  tokens [{start}, {end})  {end - start} sampled"
                     + (f" ({shown})" if shown else ""))  # fmt: skip
        if i < len(calls):
            lines += _call_lines(calls[i])
    return lines


def episode_json(state: RolloutState) -> dict[str, Any]:
    r = RolloutResult.from_state(state)
    return {
        "turns": [
            {"start": s, "end": e, "by_version": {
                str(v): n for v, n in _by_version(r.weight_versions[s:e]).items()}}
            for s, e in r.turns or ()
        ],
        "tool_calls": [c.to_dict() for c in r.tool_calls or ()],
        "context_tokens": len(r.response_token_ids),
        "observation_tokens": state.observation_tokens,
        "finish_reason": None if r.finish_reason is None else r.finish_reason.value,
    }  # fmt: skip


def _call_lines(c: EpisodeCall) -> list[str]:
    if c.name == HARNESS_CALL:
        # A harness-driven episode: the turn's end, then what its harness's next call fed.
        reason, stop = harness_commands.finish_of(c.arguments)
        ended = f"    turn ended: {reason.value}" + ("" if stop is None else f" (stop {stop})")
        if c.outcome.value != "result":
            return [f"{ended}; no next call yet" if c.outcome.value == "pending" else ended]
        end = c.offset + c.observation_tokens
        return [f"{ended}; the next call fed {c.observation_tokens} tokens at [{c.offset}, {end})"]
    over = f" over {len(c.claims)} claims" if len(c.claims) > 1 else ""
    if c.observation_tokens or c.outcome.value == "result":
        end = c.offset + c.observation_tokens
        what = f"result, {c.observation_tokens} observation tokens at [{c.offset}, {end})"
    else:
        what = c.outcome.value
    lines = [f"    call {c.call_id} {c.name} {_short(c.arguments)}: {what}, "
             f"{c.seconds:.2f}s{over}"]  # fmt: skip
    lines += [f"      {_claim_line(k)}" for k in c.claims]
    return lines


def _claim_line(k: EpisodeClaim) -> str:
    outcome = "running" if k.outcome is None else k.outcome.value
    line = f"claim {k.claim}  runner {k.runner_id}  {outcome:<9} {k.seconds:.2f}s"
    if k.error:
        line += f"  {k.error}"
    if k.decision is not None:
        line += f"; decided {k.decision.value}: {DECISIONS[k.decision.value]}"
    return line


def _ending(state: RolloutState) -> str:
    if state.status is Status.DONE:
        stop = "" if state.stop_reason is None else f" (stop {state.stop_reason})"
        reason = "?" if state.finish_reason is None else state.finish_reason.value
        return f"finished: {reason}{stop}"
    if state.status is Status.FAILED:
        kind = "?" if state.failure is None else state.failure.value
        return f"failed ({kind}): {state.error}"
    return state.status.value


def _by_version(versions: np.ndarray[Any, Any]) -> dict[int, int]:
    found, counts = np.unique(versions, return_counts=True)
    return {int(v): int(n) for v, n in zip(found, counts, strict=True)}


def _short(text: str) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= ARGUMENTS_SHOWN else flat[: ARGUMENTS_SHOWN - 3] + "..."


def _s(n: int) -> str:
    return "" if n == 1 else "s"
