"""One event's append as lua/append.lua takes it, built before any I/O (``EventStore.prepare``):
the checked event, the state after it, and the script's keys and arguments."""

from __future__ import annotations

from dataclasses import dataclass

from statemachine import Event, RolloutState
from store import scripts

# Where the record is among an event's arguments to lua/append.lua (store.batches reads it and
# the head after it, for submit_chunk.lua).
ARG_RECORD = 2


@dataclass(frozen=True, slots=True)
class _Prepared:
    event: Event
    state: RolloutState
    keys: tuple[str, ...]  # log, snapshot, completions, counters, batch record
    args: tuple[int | str | bytes, ...]  # the event's ARGV to lua/append.lua, record included

    @property
    def record(self) -> bytes:
        return self.args[ARG_RECORD]  # type: ignore[return-value]

    @property
    def head(self) -> bytes:
        """The snapshot head after the event."""
        return self.args[ARG_RECORD + 1]  # type: ignore[return-value]

    @property
    def whole(self) -> bool:
        """Whether the record goes through the script: only the Submitted record (once per
        rollout, and its log does not exist yet); every other one goes beside it, the way
        lua/append.lua describes, because Lua would hash every byte of it."""
        return self.event.seq == 1

    def script_keys(self) -> tuple[str, ...]:
        log, snap, done, _, batch = self.keys
        return log, snap, done, batch

    def script_args(self) -> tuple[int | str | bytes, ...]:
        if self.whole:
            return self.args
        return (*self.args[:ARG_RECORD], "", *self.args[ARG_RECORD + 1 :])

    def ahead(self) -> list[scripts.Step]:
        """The plain step that goes just before the script call of a header, in the same
        transaction (none for a whole one): its record's XADD, which lua/append.lua undoes if
        it refuses the event."""
        if self.whole:
            return []
        return [("XADD", self.keys[0], "NOMKSTREAM", f"0-{self.event.seq}", "e", self.record)]
