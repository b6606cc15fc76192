"""Helpers of the API tests: ending rollouts without a worker, Redis snapshots, wire bodies."""

from __future__ import annotations

import base64
import json
from typing import Any

import msgpack
import numpy as np
import redis.asyncio as aredis

from statemachine import FinishReason, RolloutState, commands
from statemachine.commands import NewTokens
from store.event_store import EventStore

MSGPACK = "application/msgpack"


async def finish(
    store: EventStore, rid: str, tokens: int, *, version: int = 0, top: int = 0
) -> RolloutState:
    """Run ``rid`` as a worker would, straight through the store: start, ``tokens`` tokens in
    one checkpoint, finish (length). ``top``: the request's ``logprobs``, whose top-k arrays
    the tokens then carry (token id + j, logprob -j)."""
    s = await store.head(rid)
    for e in commands.begin(s, worker_id="test-worker", weight_version=version,
                            weight_mode="abort", model="test"):  # fmt: skip
        s = await store.append(s, e)
    new = NewTokens(
        token_ids=np.arange(tokens, dtype=np.int32) + 100,
        logprobs=np.linspace(-1, 0, tokens, dtype=np.float32),
        weight_versions=np.full(tokens, version, dtype=np.int64),
        top_token_ids=(
            np.arange(tokens, dtype=np.int32)[:, None] + 100 + np.arange(top, dtype=np.int32)
        )
        if top
        else None,
        top_logprobs=-np.tile(np.arange(top, dtype=np.float32), (tokens, 1)) if top else None,
    )
    for e in commands.finish(s, FinishReason.LENGTH, tokens=new):
        s = await store.append(s, e)
    return s


async def dump_all(r: aredis.Redis) -> dict[bytes, tuple[Any, bool]]:
    """Every key's value byte for byte, and whether it has a TTL: its DUMP, except for hashes
    and sets, compared by their exact members and values instead. A hash or set large enough
    to be a hash table DUMPs in its table's iteration order, which a mere read can change (a
    lookup advances Redis' incremental rehashing): measured here, HMGET on a rollout's
    snapshot reordered its DUMP with no write at all."""
    out: dict[bytes, tuple[Any, bool]] = {}
    for key in sorted(await r.keys("*")):
        kind = (await r.type(key)).decode()
        if kind == "hash":
            value: Any = sorted((await r.hgetall(key)).items())  # type: ignore[misc]
        elif kind == "set":
            value = sorted(await r.smembers(key))  # type: ignore[misc]
        else:
            value = await r.dump(key)
        out[key] = (value, (await r.ttl(key)) >= 0)
    return out


def array(packed: dict[str, Any]) -> np.ndarray:
    """A packed array of a response (bytes in msgpack, base64 in JSON) as numpy."""
    data = packed["data"]
    raw = data if isinstance(data, bytes) else base64.b64decode(data)
    return np.frombuffer(raw, dtype=np.dtype(packed["dtype"]).newbyteorder("<")).reshape(
        packed["shape"]
    )


def ndjson(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line]


def msgpack_seq(raw: bytes) -> list[dict[str, Any]]:
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(raw)
    return list(unpacker)
