"""The Redis indexes of episodes' tool calls, kept by the transaction that appends their
events: each environment queue (its claimable calls) and the tool lease index (its claimed
ones). ``EventStore`` adds the step built here after the append script of every round that
holds an episode's event (``lua/tool_call_index.lua``), so a call is claimable exactly while
its episode is ``awaiting_tool``, whoever appended the event that put it there: the generation
worker's ``ToolCallRequested``, a runner's retried failure, the sweep's ``ToolCallLost``, or a
trainer's cancel that takes it off the queue. A plain rollout's append is untouched.
"""

from __future__ import annotations

from collections.abc import Sequence

from statemachine import RolloutState, harness_commands
from store import defaults, scripts
from store.keys import Keys
from store.prepared import _Prepared


def claim_fence(call_id: str, claim: int) -> str:
    """A live claim as the snapshot's ``tc`` holds it for ``lua/tool_heartbeat.lua``: the claim
    number and the call. Numbers count per call (the next call's first claim is 1 again), so
    the number alone would let a zombie runner of an earlier call renew the next call's lease
    and be told it is live. The number first: a call id may hold any character."""
    return f"{claim} {call_id}"


def live_claim(state: RolloutState) -> str:
    """The fence of the episode's pending call's live claim, "0" when none is live."""
    call = state.pending_call
    if call is None or not call.live_claim:
        return "0"
    return claim_fence(call.call_id, call.live_claim)


def wall_deadline_ms(state: RolloutState) -> str:
    """When the episode's ``max_wall_seconds`` run out, unix ms by the submitter's clock (as
    ``submitted_at`` is stamped), or, for a harness-driven episode waiting on its next call,
    when its session goes idle (``SESSION_IDLE_S`` after the turn ended, by the clock of the
    worker that ended it), whichever is first; "" when neither applies."""
    episode = state.request.episode
    if episode is None:
        return ""
    due: list[float] = []
    if episode.max_wall_seconds is not None:
        due.append(state.submitted_at + episode.max_wall_seconds)
    call = state.pending_call
    if episode.harness and call is not None:
        due.append(call.requested_at + defaults.SESSION_IDLE_S)
    return str(int(1000 * min(due))) if due else ""


def index_call(keys: Keys, calls: Sequence[_Prepared], lease_ms: int) -> scripts.Call | None:
    """The step that follows one round's append script: ``lua/tool_call_index.lua`` over the
    episodes' events of ``calls`` (None when there is none, the plain rollouts' case).
    ``lease_ms``: the lease a claim landing in the round gets."""
    script_keys: list[str] = [keys.tool_leases(), keys.leases(), keys.episode_deadlines()]
    args: list[scripts.Arg] = [lease_ms, defaults.TURN_STREAM_TTL_S]
    for p in calls:
        episode = p.state.request.episode
        if episode is None:
            continue
        if episode.harness:
            # Its turn's call waits on that call's completion stream, not on a queue.
            turn = harness_commands.current_turn(p.state)
            stream = keys.completions(harness_commands.turn_batch(p.state, turn))
            script_keys += [p.keys[1], stream, stream]
            mode = "h" if turn == 0 else "ht"
        else:
            q = episode.env_queue
            script_keys += [p.keys[1], keys.env_queue(q), keys.env_bell(q)]
            mode = ""
        args += [p.event.rollout_id, p.event.seq, p.head, live_claim(p.state),
                 wall_deadline_ms(p.state), mode]  # fmt: skip
    if len(args) == 2:
        return None
    return scripts.Call(scripts.TOOL_CALL_INDEX, script_keys, args)
