"""The frame around every stored record: a magic byte, a CRC-32 of the body, the body.

    magic | crc32(body) as 4 bytes little-endian | body (msgpack)

The CRC is there so that damaged bytes are always refused: msgpack alone would happily decode
a flipped bit inside a token id as another token id.
"""

from __future__ import annotations

from typing import Any

import msgpack

try:
    # zlib-ng's CRC-32 is zlib's (same polynomial, same values: records written either way read
    # either way) at ~15x the speed: 0.36 vs 5.3 us for a 13 KB chunk, measured. Every chunk is
    # checksummed once when written and once per read. zlib stays the fallback for a platform
    # without a zlib-ng wheel.
    from zlib_ng.zlib_ng import crc32
except ImportError:  # pragma: no cover
    from zlib import crc32

from statemachine.errors import CorruptRecord

EVENT_MAGIC = b"R"
SNAPSHOT_MAGIC = b"S"


def frame(magic: bytes, body: bytes) -> bytes:
    return magic + crc32(body).to_bytes(4, "little") + body


def unframe(magic: bytes, record: bytes, rollout_id: str | None, seq: int | None) -> bytes:
    if not isinstance(record, bytes | bytearray | memoryview):
        raise CorruptRecord(
            f"record is {type(record).__name__}, not bytes", rollout_id=rollout_id, seq=seq
        )
    record = bytes(record)
    if len(record) < 6 or record[:1] != magic:
        raise CorruptRecord("truncated record or wrong magic byte", rollout_id=rollout_id, seq=seq)
    body = record[5:]
    if crc32(body) != int.from_bytes(record[1:5], "little"):
        raise CorruptRecord(
            "checksum mismatch: record damaged or truncated", rollout_id=rollout_id, seq=seq
        )
    return body


def unpack(body: bytes) -> Any:
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=True, use_list=True)
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError) as exc:
        # Checksum matched yet msgpack refuses it: the writer itself produced garbage.
        raise ValueError(f"undecodable msgpack: {exc}") from None
