"""Reading a rollout's records out of Redis's replies: the snapshot hash's fields, the reads
of a state without its token data (``read_head``), and a log's entries decoded where they are
stored (every reader passes the rollout id and seq, which lean records need: ``codec``)."""

from __future__ import annotations

from typing import Any

from statemachine import Event, Submitted, codec
from statemachine.episode_events import TOOL_EVENTS, ToolEvent
from statemachine.errors import CorruptRecord
from store.keys import Keys

# The snapshot hash's fields (written by lua/append.lua, read only in store/): the encoded head
# of the derived scalars, the status in plain text (for the counters and acks done in Lua),
# and the id of the rollout's entry in its batch's completion stream once it ended. The
# Submitted record is read from the log's first entry (``FIRST``), which never changes:
# records written before this also kept a copy in the snapshot (field "sub", still
# recognised by lua/ack.lua), which doubled the prompt's bytes in Redis.
HEAD = "head"
FIRST = "0-1"
STATUS = "st"
COMPLETION = "cid"
JOB = "job"  # the rq job enqueued with the Submitted record (append.lua), deleted at ack


def read_head(pipe: Any, keys: Keys, rollout_id: str) -> None:
    """Queue on ``pipe`` the two reads of a rollout's state without its token data: the
    snapshot's head and the log's first entry (its ``Submitted`` record). Their replies go
    to ``decode_head`` through ``submitted_record``."""
    pipe.hget(keys.snapshot(rollout_id), HEAD)
    pipe.xrange(keys.log(rollout_id), FIRST, FIRST)


def submitted_record(entries: list[Any]) -> bytes | None:
    """The ``Submitted`` record among a log's entries (an XRANGE reply), or None."""
    if not entries or entries[0][0] != FIRST.encode():
        return None
    record: bytes | None = entries[0][1].get(b"e")
    return record


def submitted_event(rollout_id: str, record: bytes) -> Submitted:
    submitted = codec.decode(record, rollout_id=rollout_id, seq=1)
    if not isinstance(submitted, Submitted):
        raise CorruptRecord("first record is not Submitted", rollout_id=rollout_id, seq=1)
    return submitted


def decode_entries(rollout_id: str, entries: list[Any]) -> list[Event]:
    events = []
    for entry_id, fields in entries:
        # Entry ids are "0-<seq>" (see append.lua); the one field is b"e", the record.
        seq = int(entry_id.split(b"-")[1])
        events.append(codec.decode(fields[b"e"], rollout_id=rollout_id, seq=seq))
    return events


def tool_events(events: list[Event]) -> list[ToolEvent]:
    return [e for e in events if isinstance(e, TOOL_EVENTS)]
