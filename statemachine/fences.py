"""Which attempt must be live for the store to accept an event (its fence)."""

from __future__ import annotations

from statemachine.episode_events import ToolCallRequested
from statemachine.events import Aborted, Event, Finished, Resumed, Started, TokensAppended

# Events written by a worker inside one attempt: the store fences them on that attempt.
# ``ToolCallRequested`` is its attempt's last event, as ``Finished`` is. A ``Finished`` written
# between an episode's turns names attempt 0 (none), so its fence is "no attempt live".
ATTEMPT_SCOPED = (TokensAppended, Aborted, Finished, ToolCallRequested)


# Events that open an attempt: the store accepts them only while no attempt is live.
ATTEMPT_OPENING = (Started, Resumed)


def fence_of(event: Event) -> int | None:
    """The attempt that must be live for this event to be accepted: its own for an
    attempt-scoped event, none (0) for one that opens an attempt, so that no view of the
    rollout, however it was computed, opens a second attempt over a live one; None for an
    event the store does not fence. (A runner's tool-call events are fenced on their claim
    by ``transitions``, under the store's check that their seq follows the one they were
    computed from.)"""
    if isinstance(event, ATTEMPT_SCOPED):
        return event.attempt
    if isinstance(event, ATTEMPT_OPENING):
        return 0
    return None
