"""The pipe between the CPU engine and its engine-core process: framed msgpack, no pickle.

A frame is a 4-byte little-endian length and a msgpack array of messages; each message is an
array whose first item names it. Several messages travel in one frame so that one decode round
of the core (a token for every request in flight) costs one write and one wake-up on the other
side. Arrays travel as `statemachine.arrays.pack_array` triples (dtype, shape, bytes).

Front end to core:
    ["add", serial, prompt_ids, sampling_dict, resumed_tokens, prompt_routes_from | None]
    ["abort", serial]
    ["load", token, source, version]
    ["health", token]
    ["close"]
Core to front end:
    ["ready", {"vocab_size", "max_positions", "pid"}]  first, once the model is loaded
    ["fatal", kind, message]                            instead of ready, then the core exits
    ["chunk", serial, token_id, logprob, routes | None, finish | None, stop_reason, version,
     top | None, prompt_routes | None]                   top: [[k ids], [k logprobs]] (logprobs=k)
                                                         prompt_routes: first chunk, if asked
    ["error", serial, kind, message]                    the request is over
    ["loaded", token, kind | None, message]             a load finished (kind None: it worked)
    ["health", token, requests_in_flight, weight_version]
"""

from __future__ import annotations

import os
import select
import struct
from typing import Any

import msgpack

_HEADER = struct.Struct("<I")
_READ_SIZE = 1 << 20


def write_frame(fd: int, messages: list[Any]) -> None:
    """Write one frame; blocks while the pipe is full (the reader is behind: back pressure)."""
    payload = msgpack.packb(messages, use_bin_type=True)
    view = memoryview(_HEADER.pack(len(payload)) + payload)
    while view:
        view = view[os.write(fd, view) :]


class FrameReader:
    """Reads whole frames from a pipe, keeping a partial frame for the next call."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._buf = bytearray()

    def read(self, timeout: float | None) -> list[Any]:
        """The messages of every complete frame that arrives within `timeout` seconds.

        `timeout=None` blocks until at least one frame is complete; `0` only takes what is
        already there. Raises EOFError once the writer has closed its end.
        """
        wait = timeout
        while True:
            messages = self._parse()
            if messages:
                return messages
            ready, _, _ = select.select([self._fd], [], [], wait)
            if not ready:
                return []
            data = os.read(self._fd, _READ_SIZE)
            if not data:
                raise EOFError("the other end of the engine pipe is closed")
            self._buf += data
            if timeout is not None:
                wait = 0  # take what this read completed; do not wait for more

    def _parse(self) -> list[Any]:
        messages: list[Any] = []
        offset = 0
        while len(self._buf) - offset >= _HEADER.size:
            (size,) = _HEADER.unpack_from(self._buf, offset)
            end = offset + _HEADER.size + size
            if len(self._buf) < end:
                break
            messages.extend(msgpack.unpackb(self._buf[offset + _HEADER.size : end], raw=False))
            offset = end
        del self._buf[:offset]
        return messages
