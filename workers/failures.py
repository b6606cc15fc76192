"""Recording a rollout's failure, with its class, and what a failure does to its group.

Every ``Failed`` a worker records goes through ``record_failure``: the append (after any
events that must precede it in the same atomic chain, e.g. the ``Aborted`` of a lost worker),
then, under ``GroupPolicy.GROUP``, the cancel of the failed sample's siblings (a group with a
hole is useless to a GRPO trainer, so their generation would only waste the fleet).

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
    GroupPolicy,
    RolloutState,
    apply,
    commands,
)
from store import EventStore
from store.batches import info_async
from store.lifecycle import cancel
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


async def cancel_siblings(store: EventStore, failed: RolloutState) -> list[str]:
    """Under ``GroupPolicy.GROUP``, cancel the other samples of a failed rollout's group that
    have not ended (their saved tokens stay). Returns the ids cancelled. Best effort: a Redis
    error is logged, not raised, as the failure itself is recorded and the trainer sees it."""
    m = failed.membership
    if m.group_policy is not GroupPolicy.GROUP or not m.batch_id or m.group_size < 2:
        return []
    try:
        info = await info_async(store.redis, store.keys, m.batch_id)
        if info is None:
            return []  # the batch was acknowledged or expired: nothing left to cancel
        siblings = [rid for rid in info.group_ids(m.group_index) if rid != failed.rollout_id]
        kind = failed.failure.value if failed.failure is not None else "failed"
        why = f"group policy: sibling {failed.rollout_id} failed ({kind}: {failed.error})"
        cancelled = await cancel(store, siblings, why, refuse_ended=False)
    except Exception:
        # Redis unreachable (a sibling acknowledged already is skipped, not an error): the
        # siblings run on; the trainer still sees this sample's failure.
        log.warning("rollout %s: cannot cancel its group", failed.rollout_id, exc_info=True)
        return []
    if cancelled:
        log.info("rollout %s failed: cancelled its group's %s", failed.rollout_id, cancelled)
    return cancelled
