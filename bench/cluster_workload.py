"""bench_cluster.py's workload: the rollouts of one batch as the trainer makes them (ids
``<batch>.<group>.<sample>``), opened in chunks of ``append_many``, then checkpointed: a chunk of
16 tokens with 48x8 routed experts on each, ``commit`` rollouts per group commit."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from statemachine import (
    Membership,
    RolloutRequest,
    RolloutState,
    SamplingParams,
    Started,
    Submitted,
    TokensAppended,
)
from store import EventStore
from store.errors import ReplicasNotAcked

LAYERS, TOP_K, EXPERTS = 48, 8, 128
CHUNK = 16  # tokens per checkpoint of a rollout (docs/cluster-plan.md's fleet)
START_CHUNK = 256  # rollouts per append_many while submitting and starting
MAX_TOKENS = 1 << 16  # room for every round's chunks


def rollout_ids(batch: str, n: int, group: int) -> list[str]:
    """As the trainer makes them: ``<batch>.<g>.<s>``, ``group`` samples per prompt."""
    return [f"{batch}.{i // group}.{i % group}" for i in range(n)]


def opening(rid: str, batch: str, group: int) -> list[Submitted | Started]:
    """A rollout's Submitted and Started, as a chain of one ``append_many`` call."""
    _, g, s = rid.rsplit(".", 2)
    member = Membership(batch_id=batch, group_index=int(g), sample_index=int(s), group_size=group)
    request = RolloutRequest(prompt_token_ids=tuple(range(1, 65)),
                             sampling=SamplingParams(max_tokens=MAX_TOKENS))  # fmt: skip
    return [
        Submitted(rollout_id=rid, seq=1, request=request, membership=member),
        Started(rollout_id=rid, seq=2, attempt=1, worker_id="bench", weight_version=1),
    ]


async def start_all(store: EventStore, batch: str, n: int, group: int) -> list[RolloutState]:
    out: list[RolloutState] = []
    ids = rollout_ids(batch, n, group)
    for i in range(0, n, START_CHUNK):
        chains = [(None, opening(r, batch, group)) for r in ids[i : i + START_CHUNK]]
        results = await store.append_many(chains)
        out += checked(results)
    return out


def checked(results: Sequence[RolloutState | Exception]) -> list[RolloutState]:
    bad = [r for r in results if not isinstance(r, RolloutState)]
    if bad:
        raise SystemExit(f"{len(bad)} appends refused, the first: {bad[0]!r}")
    return list(results)  # type: ignore[arg-type]


def chunk_arrays(seed: int) -> dict[str, Any]:
    """One chunk's arrays, shared by every rollout of a round: building them is the engine's
    work, not the store's, and Redis stores the bytes whatever they are."""
    rng = np.random.default_rng(seed)
    return {
        "token_ids": rng.integers(0, 150_000, CHUNK, dtype=np.int32),
        "logprobs": rng.uniform(-10, 0, CHUNK).astype(np.float32),
        "weight_versions": np.ones(CHUNK, dtype=np.int64),
        "routed_experts": rng.integers(0, EXPERTS, (CHUNK, LAYERS, TOP_K), dtype=np.uint8),
    }


ACK_RETRIES = 5
ack_retries = [0]  # appends sent again after ReplicasNotAcked, over the whole run


async def checkpoint(
    store: EventStore, states: list[RolloutState], arrays: dict[str, Any]
) -> list[RolloutState]:
    """One chunk on every rollout of ``states`` in one ``append_many`` (one group commit)."""
    chains = [
        (s, [TokensAppended(rollout_id=s.rollout_id, seq=s.seq + 1, attempt=s.attempt,
                            offset=s.num_tokens, **arrays)])
        for s in states
    ]  # fmt: skip
    results = await store.append_many(chains)
    for _ in range(ACK_RETRIES):
        # A replica that fell behind past WAIT's second (a loaded machine): sent again as a
        # worker does (a repeat is recognised), and counted, not fatal.
        short = [i for i, r in enumerate(results) if isinstance(r, ReplicasNotAcked)]
        if not short:
            break
        ack_retries[0] += len(short)
        again = await store.append_many([chains[i] for i in short])
        for i, r in zip(short, again, strict=True):
            results[i] = r
    return checked(results)


async def checkpoints(
    store: EventStore, states: list[RolloutState], commit: int, seed: int
) -> list[RolloutState]:
    """A round: every rollout's chunk, ``commit`` rollouts per group commit."""
    arrays = chunk_arrays(seed)
    out: list[RolloutState] = []
    for i in range(0, len(states), commit):
        out += await checkpoint(store, states[i : i + commit], arrays)
    return out
