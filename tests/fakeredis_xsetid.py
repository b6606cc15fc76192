"""``XSETID key id`` for fakeredis, which lacks it (2.41).

``lua/append.lua`` uses it on a rare path: after undoing a refused record it puts the log's last
id back to its last entry, so the next writer of that sequence number is not refused by the
stream. Only that form is here, with the check Redis makes for it (not below the stream's top
entry); the real command is what the same tests meet on a real redis-server.
"""

from __future__ import annotations

from fakeredis._commands import Key, command
from fakeredis._core import CommandItem
from fakeredis._helpers import OK, SimpleError, SimpleString
from fakeredis.commands_mixins.streams_mixin import StreamsCommandsMixin
from fakeredis.model import StreamEntryKey, XStream


@command(name="XSETID", fixed=(Key(XStream), bytes), repeat=(bytes,))
def xsetid(
    self: StreamsCommandsMixin, key: CommandItem, last_id: bytes, *args: bytes
) -> SimpleString:
    if args:
        raise SimpleError("ERR this test double of XSETID takes no options")
    stream = key.value
    if stream is None:
        raise SimpleError("ERR no such key")
    new = StreamEntryKey.parse_str(last_id)
    if stream._ids and new < stream._ids[-1]:
        raise SimpleError("ERR The ID specified in XSETID is smaller than the stream top item")
    stream._last_id = new
    return OK


if not hasattr(StreamsCommandsMixin, "xsetid"):
    StreamsCommandsMixin.xsetid = xsetid  # type: ignore[attr-defined]
