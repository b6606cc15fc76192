"""Recording a rollout's failure, with its class, and what a failure does to its group.

Every ``Failed`` a worker records goes through ``record_failure``: the append (after any
events that must precede it in the same atomic chain, e.g. the ``Aborted`` of a lost worker),
then, under ``GroupPolicy.GROUP``, the cancel of the failed sample's siblings
(``store.group_policy``: an environment's failure of an episode applies it too).

The worker-lost budget lives here too: a rollout whose workers keep dying under it (a poison
prompt that OOM-kills every worker it lands on) fails with ``FailureClass.WORKER_LOST`` after
``MAX_WORKER_LOST`` such aborts, instead of taking down the fleet one worker at a time forever.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from statemachine import (
    Aborted,
    AbortReason,
    Event,
    FailureClass,
    RolloutState,
    apply,
    commands,
)
from store import EventStore
from store.group_policy import cancel_siblings
from store.logs import log_event

log = logging.getLogger("rollouts.failures")


async def worker_lost_aborts(store: EventStore, rollout_id: str) -> int:
    """Attempts of the rollout that ended because their worker was lost (a lapsed lease the
    reaper recorded, or a takeover). Read from the log only on those (rare) paths, so the
    snapshot needs no counter of its own."""
    events = await store.events(rollout_id)
    return sum(1 for e in events if isinstance(e, Aborted) and e.reason is AbortReason.WORKER_LOST)


async def record_failure(
    store: EventStore,
    state: RolloutState,
    error: str,
    failure: FailureClass,
    *,
    before: Sequence[Event] = (),
    worker_id: str = "",
    why: str = "",
) -> RolloutState:
    """Append ``before`` then ``Failed`` in one atomic chain, then apply the group policy.
    Raises ``AppendRefused`` (nothing written) if the rollout moved on meanwhile.
    ``worker_id``: the worker recording it (for its log line; not always the attempt's);
    ``why``: what its log line says led to it (default: the number of attempts)."""
    after = state
    for event in before:
        after = apply(after, event)  # the state ``Failed`` follows; the store checks it again
    [done] = await store.append_many([(state, [*before, commands.fail(after, error, failure)])])
    if not isinstance(done, RolloutState):
        raise done
    log_event(
        log, logging.ERROR, "failure",
        f"rollout {state.rollout_id} attempt {done.attempt} failed "
        f"{why or f'after {done.attempt} attempt(s)'} ({failure.value}): {error}",
        rollout_id=state.rollout_id, attempt=done.attempt, worker=worker_id,
        failure=failure.value, error=error,
    )  # fmt: skip
    await cancel_siblings(store, done)
    return done
