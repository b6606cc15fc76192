"""What the event store does on Redis Cluster beyond its contract: a checkpoint of many
rollouts costs one round trip per master; completions reach their batch's stream through the
slot's outbox, once, even when the appender dies in between; the counters are kept per slot
and summed; replica acknowledgement (``WAIT``) is asked per master and refused when short."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import replace
from typing import Any

import pytest
from redis.asyncio.cluster import RedisCluster as ClusterClient

from statemachine import Membership, RolloutState, Status, apply
from store import EventStore, cluster_appends, outbox
from store.cancel_safe import _CancelSafe
from store.errors import ReplicasNotAcked
from store.slot_counters import summed
from store.slots import key_slot
from tests import factories as f


@pytest.fixture
def writes(monkeypatch: pytest.MonkeyPatch) -> Counter[int]:
    """Packed writes sent, by the port of the node they went to (every connection of the
    store's clients is cancel-safe: its class writes the socket itself)."""
    sent: Counter[int] = Counter()
    original = _CancelSafe.send_packed_command

    async def counted(self: _CancelSafe, command: Any, check_health: bool = True) -> None:
        sent[int(self.port)] += 1  # type: ignore[attr-defined]
        await original(self, command, check_health)

    monkeypatch.setattr(_CancelSafe, "send_packed_command", counted)
    return sent


async def generating(store: EventStore, n: int, batch: str = "b1") -> list[RolloutState]:
    out = []
    for i in range(n):
        sub = replace(
            f.submitted(f"{batch}.{i}.0", max_tokens=8), membership=Membership(batch_id=batch)
        )
        s = await store.append(None, sub)
        out.append(await store.append(s, f.started(s)))
    return out


def masters_of(store: EventStore, states: list[RolloutState]) -> set[str]:
    assert store.on_cluster is not None
    nodes = store.on_cluster.nodes_manager
    return {nodes.get_node_from_slot(key_slot(store.keys.snapshot(s.rollout_id).encode())).name
            for s in states}  # fmt: skip


async def test_a_checkpoint_of_64_rollouts_is_one_round_trip_per_master(
    store: EventStore, writes: Counter[int]
) -> None:
    states = await generating(store, 64)
    assert len(masters_of(store, states)) == 3  # 64 rollouts land on every master
    writes.clear()
    results = await store.append_many([(s, [f.tokens(s, n=4)]) for s in states])
    assert all(isinstance(r, RolloutState) and r.num_tokens == 4 for r in results)
    assert sorted(writes.values()) == [1, 1, 1], writes
    loaded = await store.load_many([s.rollout_id for s in states])
    assert loaded == results


async def test_completions_reach_their_batch_once_through_the_outbox(
    store: EventStore, cluster_client: ClusterClient
) -> None:
    await cluster_client.hset(store.keys.batch("b1"), "ttl", 600)
    states = await generating(store, 12)
    chains = []
    for s in states:
        chunk = f.tokens(s, n=8)
        chains.append((s, [chunk, f.finished(apply(s, chunk))]))
    done = await store.append_many(chains)
    assert all(isinstance(d, RolloutState) and d.status is Status.DONE for d in done)
    entries = await cluster_client.xrange(store.keys.completions("b1"))
    assert sorted(e[1][b"r"].decode() for e in entries) == sorted(s.rollout_id for s in states)
    for eid, fields in entries:
        snap = store.keys.snapshot(fields[b"r"].decode())
        assert await cluster_client.hget(snap, "cid") == eid  # what an ack removes
        assert 0 < await cluster_client.ttl(snap) <= 600  # the retention clock started
    assert await outbox.pending(cluster_client, store.keys, older_than_ms=-60_000) == []


async def test_an_appender_dead_before_delivery_leaves_it_to_the_sweep(
    store: EventStore, cluster_client: ClusterClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    (s,) = await generating(store, 1)
    s = await store.append(s, f.tokens(s, n=8))

    async def dies(*args: Any, **kwargs: Any) -> None:
        raise ConnectionError("the appender died here")

    monkeypatch.setattr(cluster_appends, "deliver", dies)
    ended = await store.append(s, f.finished(s))
    assert ended.status is Status.DONE  # the end is stored: only its delivery waits
    done_key = store.keys.completions("b1")
    assert await cluster_client.xlen(done_key) == 0
    left = await outbox.pending(cluster_client, store.keys, older_than_ms=-60_000)
    assert [rid for _, rid in left] == [s.rollout_id]
    assert await sweep(store, older_than_ms=5_000) == 0  # its appender's, for now
    assert await sweep(store, older_than_ms=-60_000) == 1
    assert await sweep(store, older_than_ms=-60_000) == 0
    # A deliverer that had not died after all delivers again: still one entry.
    await outbox.deliver(cluster_client, store.keys, [outbox.Ended(s.rollout_id, "b1", "done")])
    (entry,) = await cluster_client.xrange(done_key)
    assert entry[1] == {b"r": s.rollout_id.encode(), b"s": b"done"}
    assert await cluster_client.hget(store.keys.snapshot(s.rollout_id), "cid") == entry[0]


async def sweep(store: EventStore, *, older_than_ms: int) -> int:
    assert store.on_cluster is not None
    return await outbox.sweep(store.on_cluster, store.keys, store.head, older_than_ms=older_than_ms)


async def test_counters_are_kept_per_slot_and_summed(store: EventStore) -> None:
    states = await generating(store, 40)
    results = await store.append_many([(s, [f.tokens(s, n=3)]) for s in states[:30]])
    await store.append_many([(r, [f.finished(r)]) for r in results[:10]])  # type: ignore[misc]
    counts = await summed(store.on_cluster, store.keys)  # type: ignore[arg-type]
    assert counts["tokens"] == 90
    assert counts["generating"] == 30 and counts["done"] == 10 and counts.get("pending", 0) == 0
    # Spread over every master, as the rollouts are.
    found = [k async for k in store.redis.scan_iter(match="dr:stats:*")]
    slots = {key_slot(k) for k in found}
    assert len(masters_of(store, states)) == 3 and len(slots) > 20


async def test_replica_acks_are_asked_per_master_and_refused_when_short(
    cluster_client: ClusterClient,
) -> None:
    acked = EventStore(cluster_client, replicas_acked=1)
    states = []
    for i in range(16):  # on every master, each with its one replica: confirmed
        sub = replace(f.submitted(f"b1.{i}.0"), membership=Membership(batch_id="b1"))
        s = await confirmed(acked, None, sub)
        states.append(await confirmed(acked, s, f.started(s)))
    greedy = EventStore(cluster_client, replicas_acked=2)  # more replicas than there are
    chunk = f.tokens(states[0], n=2)
    t0 = time.monotonic()
    with pytest.raises(ReplicasNotAcked, match=r"[01] of 2 replicas"):
        await greedy.append(states[0], chunk)
    assert time.monotonic() - t0 >= 0.9  # it waited for them (WAIT's 1 s)
    # Applied on the master though: a retry is recognised, as after any failed append.
    again = await confirmed(acked, states[0], chunk)
    assert (await acked.load(states[0].rollout_id)) == again and again.num_tokens == 2


async def confirmed(store: EventStore, state: RolloutState | None, event: Any) -> RolloutState:
    """``store.append``, sent again while a replica lags past WAIT's second (a loaded
    machine), as a worker sends a checkpoint again."""
    for _ in range(10):
        try:
            return await store.append(state, event)
        except ReplicasNotAcked:
            continue
    raise AssertionError("never confirmed")


async def test_what_a_cluster_cannot_hold_yet_is_refused_by_name(store: EventStore) -> None:
    """An episode's appends keep indexes in other slots (its environment queue): refused
    before anything is sent, as a caller's own steps in an append's transaction are."""
    with pytest.raises(cluster_appends.ClusterUnsupported, match="episodes"):
        await store.append(None, f.episode_submitted("ep"))
    assert not await store.exists("ep")
    (s,) = await generating(store, 1)
    with pytest.raises(cluster_appends.ClusterUnsupported, match="steps"):
        await store.append_chain(s, [f.tokens(s, n=1)], then=[("PING",)])
    assert await store.load(s.rollout_id) == s


async def test_every_node_connects_as_connect_does(store: EventStore) -> None:
    """Cancel-safe connections that count a MISCONF answer to their health check as alive
    (store.cancel_safe, store.connection), on every node: the seeds and those found later."""
    from store.connection import _AsyncPingAnswered

    await generating(store, 16)  # every master used
    assert store.on_cluster is not None
    nodes = store.on_cluster.nodes_manager.nodes_cache.values()
    used = [c for node in nodes for c in node._connections]
    assert len(nodes) == 6 and used
    for conn in used:
        assert isinstance(conn, _CancelSafe) and isinstance(conn, _AsyncPingAnswered)


async def test_a_groups_samples_share_a_slot_and_a_transaction(
    store: EventStore, writes: Counter[int]
) -> None:
    """Ids as submit makes them (``<batch>.<group>.<sample>``): a group's samples share their
    group's hash tag on a cluster, so a checkpoint of 8 groups of 8 is 8 transactions, each
    with one script call; ids of the caller's own keep a slot each."""
    states = []
    for g in range(8):
        for s in range(8):
            sub = f.submitted(f"b2.{g}.{s}", max_tokens=8)
            st = await store.append(None, replace(sub, membership=Membership(batch_id="b2")))
            states.append(await store.append(st, f.started(st)))
    assert store.keys.log("b2.3.5") == "dr:{b2.3}:b2.3.5:log"
    assert store.keys.log("custom") == "dr:{custom}:log"
    slots = {key_slot(store.keys.snapshot(s.rollout_id).encode()) for s in states}
    assert len(slots) == 8
    evals_before = await _evals(store)
    results = await store.append_many([(s, [f.tokens(s, n=2)]) for s in states])
    assert all(isinstance(r, RolloutState) and r.num_tokens == 2 for r in results)
    assert await _evals(store) - evals_before == 8  # one script call per group
    assert await store.load_many([s.rollout_id for s in states]) == results


async def _evals(store: EventStore) -> int:
    """EVAL calls every master has run (INFO commandstats)."""
    assert store.on_cluster is not None
    stats = await store.on_cluster.info("commandstats", target_nodes=ClusterClient.PRIMARIES)
    return sum(int(node.get("cmdstat_eval", {}).get("calls", 0)) for node in stats.values())
