"""Reading a rollout again from a state its reader already holds: only the log's entries since.

A worker that ended an episode's turn at a tool call holds the episode as that append left it.
Its next turn (whose job the result's append pushed) needs only what came since, the claim and
the result, instead of the whole log decoded again: by the last turns of bench_episodes'
16-turn episodes that log is ~100 entries and ~38 KB, 2-4 ms of CPU to decode (measured) on
the cores the worker's engine shares, and it grows with every turn. An environment runner
holds the episodes it reported on the same way, for its next claims (``EnvironmentClient``).

The held state is used only if it is provably the log's state at its seq: the entry there is
byte for byte the record its append wrote, every later entry folds onto it (``apply`` checks
each), and the fold encodes to the snapshot head read with them in one MULTI (the head every
append writes is the encoding of the fold). Anything else (the rollout deleted and submitted
again under its id, or a record that does not decode) falls back to ``EventStore.load_many``,
which reads the whole log and says what is wrong with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from statemachine import RolloutState, apply, codec
from statemachine.errors import StateMachineError
from store.event_store import HEAD, EventStore, decode_entries


@dataclass(frozen=True, slots=True)
class Held:
    """A rollout's state as an append left it, and that append's last record, as stored."""

    state: RolloutState
    record: bytes


async def read_since(store: EventStore, held: Sequence[Held]) -> list[RolloutState | None]:
    """Each held state folded forward over its log's entries since, all in one round trip;
    None for one that is not provably its log's (the caller reads that one otherwise). A held
    state without token data (``EventStore.head``'s) folds into one with only the chunks since:
    a caller that wants a head drops them."""
    async with store.redis.pipeline(transaction=True) as pipe:
        for h in held:
            rid = h.state.rollout_id
            pipe.hget(store.keys.snapshot(rid), HEAD)
            pipe.xrange(store.keys.log(rid), f"0-{h.state.seq}", "+")
        replies = await pipe.execute(raise_on_error=False)
    return [_advance(h, replies[2 * i], replies[2 * i + 1]) for i, h in enumerate(held)]


async def load_held(store: EventStore, held: Sequence[Held]) -> list[RolloutState | Exception]:
    """``EventStore.load_many`` of the rollouts ``held`` names, in one round trip when every
    held state is still the log's prefix (two when one is not: the whole read of those)."""
    advanced = await read_since(store, held)
    again = [h.state.rollout_id for h, state in zip(held, advanced, strict=True) if state is None]
    whole = iter(await store.load_many(again) if again else [])
    return [next(whole) if state is None else state for state in advanced]


def _advance(h: Held, head: Any, entries: Any) -> RolloutState | None:
    """The held state folded forward over the entries since, or None if it is not provably
    the log's (the caller then reads the log whole)."""
    if not isinstance(head, bytes) or not isinstance(entries, list) or not entries:
        return None
    entry_id, fields = entries[0]
    if entry_id != f"0-{h.state.seq}".encode() or fields.get(b"e") != h.record:
        return None
    state = h.state
    try:
        for event in decode_entries(state.rollout_id, entries[1:]):
            state = apply(state, event)
    except (StateMachineError, KeyError, ValueError):
        # A record that does not decode or fold: the whole read reports it as it should.
        return None
    return state if codec.encode_snapshot(state) == head else None
