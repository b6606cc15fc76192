"""A harness call's answer: one turn of its harness-driven episode (``store.harness_turns``),
as a plain rollout's result. The call's prompt is the episode's prompt and its context before
the turn (what the harness sent); its response is the tokens the turn sampled, with their
logprobs, weight versions, routes and top-k, and how the turn ended."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from statemachine import FinishReason, Status, harness_commands
from statemachine.episode_events import HARNESS_CALL
from store.results import RolloutResult, Tokenizer

HARNESS_METADATA = "harness"  # set (True) in a harness-driven episode's request metadata


def is_harness(result: RolloutResult) -> bool:
    """Whether ``result`` is a harness-driven episode's whole result."""
    return result.loss_mask is not None and result.metadata.get(HARNESS_METADATA) is True


def turn_result(
    full: RolloutResult, turn: int, batch_id: str, tokenizer: Tokenizer | None = None
) -> RolloutResult:
    """What call ``batch_id`` is answered: turn ``turn`` of the episode whose whole result is
    ``full``, as a plain rollout's result (its prompt the call's: the episode's prompt and
    context before the turn; its response the turn's sampled tokens)."""
    assert full.turns is not None and full.tool_calls is not None  # an episode's result
    context = len(full.response_token_ids)
    start, end = full.turns[turn] if turn < len(full.turns) else (context, context)
    calls = [c for c in full.tool_calls if c.name == HARNESS_CALL]
    finish: tuple[FinishReason | None, int | str | None]
    if turn < len(calls):  # the turn ended and the episode waited for the next call
        finish = harness_commands.finish_of(calls[turn].arguments)
        status: Status = Status.DONE
    else:
        finish = (full.finish_reason, full.stop_reason)
        status = full.status
    span = slice(start, end)

    def cut(a: Any) -> Any:
        return None if a is None else a[span]

    ids = full.response_token_ids[span]
    return replace(
        full,
        status=status,
        prompt_token_ids=full.prompt_token_ids + tuple(full.response_token_ids[:start].tolist()),
        response_token_ids=ids,
        logprobs=full.logprobs[span],
        weight_versions=full.weight_versions[span],
        routed_experts=cut(full.routed_experts),
        top_token_ids=cut(full.top_token_ids),
        top_logprobs=cut(full.top_logprobs),
        finish_reason=finish[0],
        stop_reason=finish[1],
        text=None
        if tokenizer is None
        else tokenizer.decode(ids.tolist(), skip_special_tokens=True),
        batch_id=batch_id,
        loss_mask=None,
        turns=None,
        tool_calls=None,
        routes_present=None,
        position="",
    )
