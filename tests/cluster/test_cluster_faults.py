"""The event store on a Redis Cluster that loses a master, or moves slots, while a writer
appends: with replica acknowledgement on, no acknowledged token is lost, and every append
goes through (retried by the writer, as a worker retries a failed checkpoint). Each test
starts a cluster of its own, since it harms it."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

import pytest
from redis.asyncio.cluster import RedisCluster as RedisClusterClient
from redis.exceptions import RedisError

from statemachine import Membership, RolloutState
from store import EventStore, cluster_commit
from store.connection import connect_cluster
from store.errors import StoreError
from store.redis_cluster import RedisCluster
from store.slots import key_slot
from tests import factories as f
from tests.cluster.conftest import LIGHT

pytestmark = pytest.mark.slow
T = TypeVar("T")


async def _generating(store: EventStore, n: int) -> list[RolloutState]:
    out = []
    for i in range(n):
        sub = f.submitted(f"b.{i}.0", max_tokens=4096)
        s = await store.append(None, replace(sub, membership=Membership(batch_id="b")))
        out.append(await store.append(s, f.started(s)))
    return out


class Writer:
    """Rounds of a 2-token chunk on every rollout in one ``append_many``, each round retried
    as it was until it is acknowledged (what ``workers.checkpoint`` does with a failed one)."""

    def __init__(self, store: EventStore, states: list[RolloutState]) -> None:
        self.store, self.states = store, states
        self.acked = {s.rollout_id: s for s in states}  # the last acknowledged state of each
        self.rounds = self.failures = 0  # failures: tries that raised, retried by the writer
        self.slowest = 0.0  # the longest round, its retries (the store's and the writer's) in

    async def round(self) -> None:
        chains = [(s, [f.tokens(s, n=2)]) for s in self.states]
        t0 = time.monotonic()
        while True:
            try:
                results = await self.store.append_many(chains)
                break
            except (RedisError, StoreError, OSError):
                self.failures += 1
                await asyncio.sleep(0.2)
        for r in results:
            assert isinstance(r, RolloutState), r  # a retry is recognised, never refused
            self.acked[r.rollout_id] = r
        self.states = [r for r in results if isinstance(r, RolloutState)]
        self.rounds += 1
        self.slowest = max(self.slowest, time.monotonic() - t0)

    async def during(self, fault: Awaitable[T]) -> T:
        """Rounds, one after another, while ``fault`` runs, then 5 more; what it returned."""
        done = asyncio.Event()

        async def rounds() -> None:
            while not done.is_set():
                await self.round()
            for _ in range(5):
                await self.round()

        running = asyncio.ensure_future(rounds())
        try:
            result = await fault
        finally:
            done.set()
        await running
        return result

    async def check(self) -> None:
        for rid, acked in self.acked.items():
            assert await self.store.load(rid) == acked
        assert all(s.num_tokens == 2 * self.rounds for s in self.acked.values())


async def test_a_master_killed_mid_run_loses_no_acknowledged_token(tmp_path: Path) -> None:
    with RedisCluster(tmp_path, node_timeout_ms=1000, config=LIGHT) as cluster:
        client = connect_cluster(cluster.url)
        store = EventStore(client, replicas_acked=1)
        writer = Writer(store, await _generating(store, 48))
        for _ in range(5):
            await writer.round()
        victim = cluster.master_ports()[0]
        killed = time.monotonic()

        async def failover() -> None:
            await asyncio.to_thread(cluster.node(victim).stop, kill=True)
            await asyncio.to_thread(cluster.wait_promoted, victim, 30)
            # Promoted, the replica has no replica of its own: its appends are not acknowledged
            # (ReplicasNotAcked, retried) until the dead master is back as its replica.
            await asyncio.to_thread(cluster.node(victim).start)

        # SIGKILLed while rounds run: its replica holds what was acknowledged.
        await writer.during(failover())
        back = time.monotonic() - killed
        await writer.check()
        # The failover was met mid-round, and ridden out: by the store's own retries, or the
        # writer's after a ReplicasNotAcked (the promoted replica has none until the old
        # master is back as its replica).
        assert writer.slowest > 1.0
        print(
            f"rounds {writer.rounds}, failed tries {writer.failures}, "
            f"slowest round {writer.slowest:.1f} s, back in {back:.1f} s"
        )
        await client.aclose()


async def test_slots_migrated_mid_run_lose_nothing(tmp_path: Path) -> None:
    with RedisCluster(tmp_path, replicas=0, config=LIGHT) as cluster:
        client = connect_cluster(cluster.url)
        store = EventStore(client)
        writer = Writer(store, await _generating(store, 64))
        source, target = cluster.master_ports()[:2]
        ids = [cluster.cli(p, "CLUSTER", "MYID").strip() for p in (source, target)]
        reshard = asyncio.to_thread(
            cluster.cli, source, "--cluster", "reshard", f"127.0.0.1:{source}",
            "--cluster-from", ids[0], "--cluster-to", ids[1], "--cluster-slots", "2000",
            "--cluster-yes", timeout=120,
        )  # fmt: skip

        cluster_commit.resent.clear()
        moved = await writer.during(reshard)
        assert "Moving slot" in moved
        # Blocks met slots on the move (ASK, TRYAGAIN) or moved (MOVED), and went again.
        assert sum(cluster_commit.resent.values()) > 0
        await writer.check()
        print(
            f"rounds {writer.rounds}, failed tries {writer.failures}, "
            f"slowest round {writer.slowest:.1f} s, resent {dict(cluster_commit.resent)}"
        )
        await client.aclose()


async def test_a_master_down_for_good_fails_its_own_chains_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No replica to take over: after the retry window the dead master's chains get its error,
    and every other master's chains are stored and answered as such (a worker retries only
    those that failed)."""
    monkeypatch.setattr(cluster_commit, "WINDOW_S", 1.0)
    with RedisCluster(tmp_path, replicas=0, node_timeout_ms=1000, config=LIGHT) as cluster:
        client = connect_cluster(cluster.url)
        store = EventStore(client)
        states = await _generating(store, 48)
        victim = cluster.master_ports()[0]
        cluster.node(victim).stop(kill=True)
        results = await store.append_many([(s, [f.tokens(s, n=2)]) for s in states])
        nodes = client.nodes_manager
        for s, r in zip(states, results, strict=True):
            slot = key_slot(store.keys.snapshot(s.rollout_id).encode())
            if nodes.get_node_from_slot(slot).port == victim:
                assert isinstance(r, (RedisError, OSError)), r
            else:
                assert isinstance(r, RolloutState) and r.num_tokens == 2
                assert await store.load(s.rollout_id) == r
        lost = sum(not isinstance(r, RolloutState) for r in results)
        assert 0 < lost < len(states)
        await client.aclose()


def _key_on(client: RedisClusterClient, port: int, avoid: set[str]) -> str:
    """A key whose slot the master on ``port`` serves."""
    for i in range(100_000):
        key = f"k{i}"
        node = client.nodes_manager.get_node_from_slot(key_slot(key.encode()))
        if node.port == port and key not in avoid:
            return key
    raise AssertionError(f"no key found on {port}")


def _until_replicated(cluster: RedisCluster, timeout: float = 30.0) -> None:
    """Until every master's replicas have its whole replication stream."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        infos = [cluster.info(port, "replication") for port in cluster.master_ports()]
        if all(
            (links := [v for k, v in info.items() if re.fullmatch(r"slave\d+", k)])
            and all(f"offset={info['master_repl_offset']}," in link for link in links)
            for info in infos
        ):
            return
        time.sleep(0.05)
    raise AssertionError("the replicas never caught up")


async def test_plain_commands_ride_out_a_failover(tmp_path: Path) -> None:
    """Every command the workers send outside their checkpoints (a rollout's load, a lease
    read, the fleet's beat) waits out a master's failover rather than failing at once: a run
    that failed on one gave its job back with its attempt still open and its lease held, and
    the job, met again, was dropped as a duplicate of that attempt, which the reaper took over
    only when its lease lapsed (a worker_lost charged, the rollout stalled for the lease TTL;
    seen in CI). redis-py's cluster client re-reads the slot map after a connection error, but
    that re-read asks the first master it knows for its command table, the dead one, and
    fails; it retries nothing then, and its own retries go without a pause."""
    with RedisCluster(tmp_path, node_timeout_ms=1000, config=LIGHT) as cluster:
        client = connect_cluster(cluster.url)
        await client.ping()
        ports = cluster.master_ports()
        keys = {port: _key_on(client, port, set()) for port in ports}
        for port, key in keys.items():
            await client.set(key, port)
        # Replicated before the kill (replication is asynchronous: a key set just before could
        # be missing from the promoted replica, which is not what this test is about).
        await asyncio.to_thread(_until_replicated, cluster)
        victim = ports[0]
        await asyncio.to_thread(cluster.node(victim).stop, kill=True)
        failed: list[BaseException] = []
        t0 = time.monotonic()
        while time.monotonic() - t0 < 4.0:  # the failover takes ~2.5 s at 1000 ms
            for port, key in keys.items():
                try:
                    assert int(await client.get(key)) == port
                except (RedisError, OSError) as exc:
                    failed.append(exc)
            pipe = client.pipeline(transaction=False)  # a batch per master, as the leases go
            for key in keys.values():
                pipe.get(key)
            try:
                assert [int(v) for v in await pipe.execute()] == list(keys)
            except (RedisError, OSError) as exc:
                failed.append(exc)
            await asyncio.sleep(0.05)
        assert failed == [], [repr(exc) for exc in failed]
        await client.aclose()
