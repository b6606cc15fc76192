"""The CPU engine's pipe framing: whole messages out, however the bytes arrive."""

from __future__ import annotations

import os
import threading

import pytest

from workers.engines.cpu.wire import FrameReader, write_frame


def framed(messages: list[list[object]]) -> bytes:
    r, w = os.pipe()
    try:
        write_frame(w, messages)
        os.close(w)
        out = b""
        while chunk := os.read(r, 1 << 16):
            out += chunk
        return out
    finally:
        os.close(r)


def test_frames_split_anywhere_read_whole() -> None:
    frames = [
        [["chunk", 1, 5, -0.5, None, None, None, 0]],
        [["error", 2, "EngineError", "boom"], ["health", 7, 3, 1]],
        [["chunk", 3, 9, -1.25, ["|u1", [1, 2, 2], b"\x01\x02\x03\x04"], "stop", "</s>", 4]],
    ]
    data = b"".join(framed(f) for f in frames)
    expected = [m for f in frames for m in f]
    for cut in range(1, len(data)):
        r, w = os.pipe()
        reader = FrameReader(r)
        got: list[object] = []
        try:
            os.write(w, data[:cut])
            got += reader.read(0)
            os.write(w, data[cut:])
            while len(got) < len(expected):
                got += reader.read(None)
        finally:
            os.close(r)
            os.close(w)
        assert got == expected, cut


def test_eof_is_reported() -> None:
    r, w = os.pipe()
    reader = FrameReader(r)
    os.close(w)
    with pytest.raises(EOFError):
        reader.read(None)
    os.close(r)


def test_a_frame_larger_than_the_pipe_buffer() -> None:
    """The writer blocks until the reader drains (back pressure), and nothing is torn."""
    r, w = os.pipe()
    big = [["blob", b"x" * (1 << 20)]]
    writer = threading.Thread(target=write_frame, args=(w, big))
    writer.start()
    got = FrameReader(r).read(None)
    writer.join()
    os.close(r)
    os.close(w)
    assert got == big
