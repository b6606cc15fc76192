"""The event store on Redis Cluster (issue 32, point 5): what this 2-core machine can honestly
show, measured side by side in one run on real loopback clusters (``store.redis_cluster``).

- Spread: ``--rollouts`` rollouts of one batch (ids ``<batch>.<g>.<s>`` as the trainer makes
  them, in groups of ``--group-size``, 8: a group shares a slot) submitted and started on 3
  masters with ``--replicas`` each, through ``append_many`` 256 at a time; then ``--rounds``
  checkpoints of every rollout: a chunk of 16 tokens with 48x8 routed experts each,
  ``--commit`` rollouts per ``append_many`` (a worker's in-flight count), no replica acks,
  after one round uncounted (the workload: ``cluster_workload.py``). Per master: its keys (DBSIZE)
  and, over the checkpoints, the commands it processed and the CPU it used (INFO deltas):
  ``load_max_over_mean`` (keys), ``commands_max_over_mean``, ``cpu_max_over_mean``.
- Cost per stored token: each master's CPU (``used_cpu_user + used_cpu_sys``, all its threads:
  parsing, scripts, AOF with ``appendfsync --fsync``, feeding its replica), memory
  (``used_memory``) and bytes received over the checkpoints, over the tokens stored on it
  (counted from the slot map). CPU seconds, not wall time: two cores run every node and the
  client, so throughput here says nothing of a real fleet, but a token's cost holds (somewhat
  inflated by the contention). Beside it, the same on one plain redis-server (no replica):
  ``cluster_over_single_cpu_ratio``, what spreading a group commit over slots costs a token.
- The same for groups of 1 (every rollout its own group, so its own slot: a transaction and a
  script call each), after the main side on the same cluster: ``--n1-rollouts`` rollouts,
  ``--n1-rounds`` counted checkpoints after one uncounted (10,000 and 2, as the main side's:
  ~15 s of the 46-51 s a default run takes here), and the same on one plain redis-server
  (whose keys are never grouped): ``cpu_us_per_token_cluster_n1``,
  ``single_redis_cpu_us_per_token_n1``, ``cluster_over_single_cpu_ratio_n1``, and
  ``cluster_n1_over_grouped_cpu_ratio`` (n=1 over the main side on the cluster: what a
  group's shared slot saves). Skipped with
  ``--group-size 1`` (the main side is that) or ``--n1-rollouts 0``.
- Round trips: clusters of ``--sizes`` masters (no replicas), ``--commits`` checkpoints of
  ``--commit`` rollouts each, the packed writes every node received counted (as
  tests/cluster/test_cluster_store.py does): ``round_trips_per_commit`` and, per master the
  commit touched, ``round_trips_per_commit_per_master`` (the design: 1.0).
- Replica acks: ``--ack-rounds`` checkpoints of ``--commit`` rollouts with ``replicas_acked`` 0
  and 1 in turn (each going first in every other round) on the same rollouts of the 3+3
  cluster: ``appends_per_s_acks0``, ``appends_per_s_acks1`` (one writer, median commit) and
  ``replica_ack_cost_ratio`` (acks1 / acks0).
- Capacity: masters needed for 100k, 1M and 10M tokens/s of 16-token chunks with 48x8 routes,
  assuming a master saturates one core of which ``--usable`` is planned: ceil(rate x CPU per
  token of the busiest master / usable), where the busiest master's CPU per token is the mean
  times ``cpu_max_over_mean``; and each master's memory per minute of retention (rate x 60 x
  bytes per token / masters; each replica holds as much again) and ingress.
- The lease index at 1,000 workers (``lease_shards.py``, its docstring says how): Redis CPU per
  heartbeat renewal of 128 leases and per reaper pass on one index of ``--lease-workers`` x
  128 leases against 16 shards of it, on one plain redis-server, and the share of a core the
  one index, and one shard, takes at 1,000 workers: ``lease_index_core_share_at_1000_workers``,
  ``lease_shard_core_share_at_1000_workers``. ``--lease-workers 0``: skipped.

``--json`` prints one object (``load_max_over_mean``, ``round_trips_per_commit_per_master`` at
3 masters, ``table``, beside the rest); without it, the figures and the table, readable.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import statistics
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import redis.asyncio as aredis

# Its modules (run as a script, bench/ is on the path already), then the project ahead of an
# installed copy.
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cluster_workload import (
    CHUNK,
    LAYERS,
    TOP_K,
    ack_retries,
    checkpoint,
    checkpoints,
    chunk_arrays,
    start_all,
)
from lease_shards import FLEET, lease_index

from statemachine import RolloutState
from store import EventStore
from store.cancel_safe import _CancelSafe
from store.connection import connect_cluster
from store.redis_cluster import RedisCluster
from store.redis_server import RedisServer
from store.slots import key_slot

RATES = (100_000, 1_000_000, 10_000_000)
SINGLE_ROLLOUTS = 2048  # the one-Redis baseline's: its cost per token does not grow with more
N1_ROLLOUTS = 10_000


@contextlib.contextmanager
def writes_counted() -> Iterator[Counter[int]]:
    """Packed writes sent (one per round trip), by the port of the node they went to."""
    sent: Counter[int] = Counter()
    # The store's connections are cancel-safe (store.connection): that class writes the socket.
    original = _CancelSafe.send_packed_command

    async def counted(self: Any, command: Any, check_health: bool = True) -> None:
        sent[int(self.port)] += 1
        await original(self, command, check_health)

    _CancelSafe.send_packed_command = counted  # type: ignore[method-assign]
    try:
        yield sent
    finally:
        _CancelSafe.send_packed_command = original  # type: ignore[method-assign]


def reading(cluster: RedisCluster, port: int) -> dict[str, float]:
    """What a node has used so far (INFO), and its keys."""
    cpu, stats = cluster.info(port, "cpu"), cluster.info(port, "stats")
    out = {
        "cpu": float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"]),
        "cpu_sys": float(cpu["used_cpu_sys"]),
        "commands": float(stats["total_commands_processed"]),
        "net_in": float(stats["total_net_input_bytes"]),
        "memory": float(cluster.info(port, "memory")["used_memory"]),
        "keys": float(cluster.cli(port, "DBSIZE").strip()),
    }
    for name, value in cluster.info(port, "commandstats").items():
        if name in ("cmdstat_eval", "cmdstat_xadd"):
            fields = dict(kv.split("=") for kv in value.split(","))
            out[f"{name[8:]}_calls"] = float(fields["calls"])
            out[f"{name[8:]}_usec"] = float(fields["usec"])
    return out


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}


def max_over_mean(values: Sequence[float]) -> float:
    return round(max(values) / statistics.mean(values), 4)


async def single_redis(args: argparse.Namespace, n: int, group: int, rounds: int) -> float:
    """Redis CPU per token of the same checkpoints on one plain redis-server (no cluster, no
    replica), where a group commit is one MULTI/EXEC with one script call for all its
    rollouts: the baseline the cluster's per-slot blocks are compared with."""
    n = min(n, SINGLE_ROLLOUTS)
    with RedisServer(config={"appendfsync": args.fsync}) as server:
        client = aredis.Redis.from_url(server.url)
        store = EventStore(client)
        states = await start_all(store, "one", n, group)
        states = await checkpoints(store, states, args.commit, seed=rounds)  # as the cluster's
        cpu = -await server_cpu(client)
        for r in range(rounds):
            states = await checkpoints(store, states, args.commit, seed=r)
        cpu += await server_cpu(client)
        await client.aclose()
    return cpu / (n * CHUNK * rounds)


async def server_cpu(client: aredis.Redis) -> float:
    info = await client.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


async def round_trips(masters: int, args: argparse.Namespace) -> dict[str, Any]:
    """A cluster of ``masters`` masters: the packed writes per group commit of ``--commit``
    rollouts, per master it touched, and the commit's median wall time (2 cores: a figure to
    read, not to scale)."""
    config = {"appendfsync": args.fsync}
    with RedisCluster(masters=masters, replicas=0, config=config) as cluster:
        client = connect_cluster(cluster.url)
        store = EventStore(client)
        states = await start_all(store, f"rt{masters}", args.commit, args.group_size)  # connects
        times = []
        with writes_counted() as sent:
            for k in range(args.commits):
                t0 = time.perf_counter()
                states = await checkpoint(store, states, chunk_arrays(k))
                times.append(time.perf_counter() - t0)
        await client.aclose()
    total = sum(sent.values()) / args.commits
    return {
        "masters": masters,
        "masters_touched": len(sent),
        "round_trips_per_commit": round(total, 4),
        "round_trips_per_commit_per_master": round(total / len(sent), 4),
        "commit_ms": round(statistics.median(times) * 1000, 2),
    }


async def spread_and_cost(cluster: RedisCluster, args: argparse.Namespace) -> dict[str, Any]:
    """Keys and load per master, then each master's cost per stored token, then replica acks."""
    client = connect_cluster(cluster.url)
    store = EventStore(client)
    t0 = time.perf_counter()
    states = await start_all(store, "step-1", args.rollouts, args.group_size)
    started_s = time.perf_counter() - t0
    ports = cluster.master_ports()
    replica_ports = [n.port for n in cluster.nodes if n.port not in ports]
    by_port = Counter(
        client.nodes_manager.get_node_from_slot(key_slot(store.keys.snapshot(s.rollout_id).encode())).port
        for s in states
    )  # fmt: skip
    # A first round uncounted: a stream's first chunk frees the room its first node was given
    # (stream-node-max-bytes), which would make a token look ~25% smaller than it stays.
    states = await checkpoints(store, states, args.commit, seed=args.rounds)
    before = {p: reading(cluster, p) for p in ports + replica_ports}
    t0 = time.perf_counter()
    for r in range(args.rounds):
        states = await checkpoints(store, states, args.commit, seed=r)
    wall = time.perf_counter() - t0
    after = {p: reading(cluster, p) for p in ports + replica_ports}
    used = {p: delta(before[p], after[p]) for p in ports + replica_ports}
    tokens = {p: by_port[p] * CHUNK * args.rounds for p in ports}
    total_tokens = sum(tokens.values())
    master_cpu = sum(used[p]["cpu"] for p in ports)
    cpu_max = max_over_mean([used[p]["cpu"] for p in ports])
    evals = sum(used[p].get("eval_calls", 0) for p in ports)
    xadds = sum(used[p].get("xadd_calls", 0) for p in ports)
    out: dict[str, Any] = {
        "rollouts_per_master": [by_port[p] for p in ports],
        "keys_per_master": [int(after[p]["keys"]) for p in ports],
        "submit_and_start_rollouts_per_s": round(args.rollouts / started_s, 1),
        "load_max_over_mean": max_over_mean([after[p]["keys"] for p in ports]),
        "commands_max_over_mean": max_over_mean([used[p]["commands"] for p in ports]),
        "cpu_max_over_mean": cpu_max,
        "tokens_stored": total_tokens,
        "checkpoint_tokens_per_s": round(total_tokens / wall, 1),
        "cpu_us_per_token_per_master": [round(used[p]["cpu"] / tokens[p] * 1e6, 3) for p in ports],
        "cpu_us_per_token": round(master_cpu / total_tokens * 1e6, 3),
        # The kernel's part (writes to the AOF, fsync, the sockets, fresh pages).
        "cpu_sys_share": round(sum(used[p]["cpu_sys"] for p in ports) / master_cpu, 3),
        "replica_cpu_us_per_token": round(
            sum(used[p]["cpu"] for p in replica_ports) / total_tokens * 1e6, 3
        ),
        "bytes_per_token_per_master": [round(used[p]["memory"] / tokens[p], 1) for p in ports],
        "bytes_per_token": round(sum(used[p]["memory"] for p in ports) / total_tokens, 1),
        "net_in_bytes_per_token": round(sum(used[p]["net_in"] for p in ports) / total_tokens, 1),
        "commands_per_token": round(sum(used[p]["commands"] for p in ports) / total_tokens, 4),
        # Where a master's time goes, by Redis's own clock (commandstats): EVAL carries the
        # append script's text, sent once per slot block (cluster_commit), XADD the record.
        # Wall time inside the command: inflated whenever the 2 cores are contended.
        "eval_wall_us_per_call": round(sum(used[p].get("eval_usec", 0) for p in ports) / evals, 2),
        "xadd_wall_us_per_call": round(sum(used[p].get("xadd_usec", 0) for p in ports) / xadds, 2),
        "evals_per_rollout_checkpoint": round(evals / (args.rollouts * args.rounds), 4),
    }
    if args.replicas:
        out.update(await replica_acks(client, states[: args.commit], args))
    await client.aclose()
    return out


async def cluster_n1(cluster: RedisCluster, args: argparse.Namespace) -> float:
    """Master CPU per token of the same checkpoints on the same cluster, after the main side,
    on ``--n1-rollouts`` rollouts each of its own group (``n`` = 1), so each its own slot: a
    transaction and a script call per rollout where a group shares one."""
    client = connect_cluster(cluster.url)
    store = EventStore(client)
    states = await start_all(store, "step-n1", args.n1_rollouts, 1)
    states = await checkpoints(store, states, args.commit, seed=args.n1_rounds)  # uncounted
    ports = cluster.master_ports()
    cpu = -sum(reading(cluster, p)["cpu"] for p in ports)
    for r in range(args.n1_rounds):
        states = await checkpoints(store, states, args.commit, seed=r)
    cpu += sum(reading(cluster, p)["cpu"] for p in ports)
    await client.aclose()
    return float(cpu / (args.n1_rollouts * CHUNK * args.n1_rounds))


async def replica_acks(
    client: Any, states: list[RolloutState], args: argparse.Namespace
) -> dict[str, float]:
    """The same checkpoints with 0 and 1 replica acks in turn, each side first in every other
    round so that neither gains from a warm cache or loses to the machine drifting."""
    stores = {acks: EventStore(client, replicas_acked=acks) for acks in (0, 1)}
    times: dict[int, list[float]] = {0: [], 1: []}
    for r in range(args.ack_rounds):
        for acks in (0, 1) if r % 2 == 0 else (1, 0):
            arrays = chunk_arrays(1000 + 2 * r + acks)
            t0 = time.perf_counter()
            states = await checkpoint(stores[acks], states, arrays)
            times[acks].append(time.perf_counter() - t0)
    per_s = {acks: len(states) / statistics.median(t) for acks, t in times.items()}
    return {
        "appends_per_s_acks0": round(per_s[0], 1),
        "appends_per_s_acks1": round(per_s[1], 1),
        "replica_ack_cost_ratio": round(per_s[1] / per_s[0], 4),
        "commit_ms_acks0": round(statistics.median(times[0]) * 1000, 2),
        "commit_ms_acks1": round(statistics.median(times[1]) * 1000, 2),
        "ack_retries": ack_retries[0],
    }


def capacity(figures: dict[str, Any], usable: float, replicas: int) -> list[dict[str, Any]]:
    """Masters for each rate in ``RATES``: the busiest master must stay under ``usable`` of
    the one core a Redis master's main thread can use."""
    cpu_s = figures["cpu_us_per_token"] * figures["cpu_max_over_mean"] / 1e6
    rows = []
    for rate in RATES:
        masters = max(1, math.ceil(rate * cpu_s / usable))
        rows.append({
            "tokens_per_s": rate,
            "masters": masters,
            "nodes": masters * (1 + replicas),
            "master_cores_busy": round(rate * figures["cpu_us_per_token"] / 1e6, 2),
            "memory_gb_per_master_per_min": round(
                rate * 60 * figures["bytes_per_token"] / masters / 1e9, 2),
            "ingress_mb_per_s_per_master": round(
                rate * figures["net_in_bytes_per_token"] / masters / 1e6, 1),
        })  # fmt: skip
    return rows


async def main(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    sizes = [await round_trips(m, args) for m in args.sizes]
    with RedisCluster(masters=3, replicas=args.replicas, config={"appendfsync": args.fsync}) as c:
        figures = await spread_and_cost(c, args)
        n1 = await cluster_n1(c, args) if args.n1_rollouts and args.group_size > 1 else None
    single = await single_redis(args, args.rollouts, args.group_size, args.rounds)
    figures["single_redis_cpu_us_per_token"] = round(single * 1e6, 3)
    figures["cluster_over_single_cpu_ratio"] = round(figures["cpu_us_per_token"] / single / 1e6, 3)
    if n1 is not None:
        single_n1 = await single_redis(args, args.n1_rollouts, 1, args.n1_rounds)
        figures |= {
            "cpu_us_per_token_cluster_n1": round(n1 * 1e6, 3),
            "single_redis_cpu_us_per_token_n1": round(single_n1 * 1e6, 3),
            "cluster_over_single_cpu_ratio_n1": round(n1 / single_n1, 3),
            # What sharing a group's slot saves a token on the cluster.
            "cluster_n1_over_grouped_cpu_ratio": round(n1 * 1e6 / figures["cpu_us_per_token"], 3),
        }
    if args.lease_workers:
        figures |= await lease_index(args.fsync, args.lease_workers, args.lease_rounds)
    at3 = next((s for s in sizes if s["masters"] == 3), None)
    workload = ("rollouts", "group_size", "rounds", "commit", "commits", "ack_rounds",
                "replicas", "fsync", "usable", "n1_rollouts", "n1_rounds", "lease_workers",
                "lease_rounds")  # fmt: skip
    return {
        "workload": {
            **{k: getattr(args, k) for k in workload},
            "tokens_per_chunk": CHUNK,
            "routes": f"{LAYERS}x{TOP_K}",
        },
        **figures,
        "round_trips_per_commit": None if at3 is None else at3["round_trips_per_commit"],
        "round_trips_per_commit_per_master": (
            None if at3 is None else at3["round_trips_per_commit_per_master"]
        ),
        "round_trips_by_masters": sizes,
        "table": capacity(figures, args.usable, args.replicas),
        "wall_s": round(time.perf_counter() - t0, 1),
    }


def show(result: dict[str, Any]) -> None:
    for key, value in result.items():
        if key not in ("table", "round_trips_by_masters"):
            print(f"{key:44s} {value}")
    print("\nround trips per group commit as masters grow")
    print(f"{'masters':>8} {'touched':>8} {'per commit':>11} {'per master':>11} {'ms':>8}")
    for s in result["round_trips_by_masters"]:
        print(f"{s['masters']:>8} {s['masters_touched']:>8} {s['round_trips_per_commit']:>11} "
              f"{s['round_trips_per_commit_per_master']:>11} {s['commit_ms']:>8}")  # fmt: skip
    usable = result["workload"]["usable"]
    print(f"\nmasters needed (one core each, {usable:.0%} of it planned), "
          f"{CHUNK}-token chunks with {LAYERS}x{TOP_K} routes")  # fmt: skip
    print(f"{'tokens/s':>11} {'masters':>8} {'nodes':>6} {'cores busy':>11} "
          f"{'GB/master/min':>14} {'MB/s in/master':>15}")  # fmt: skip
    for row in result["table"]:
        print(f"{row['tokens_per_s']:>11,} {row['masters']:>8} {row['nodes']:>6} "
              f"{row['master_cores_busy']:>11} {row['memory_gb_per_master_per_min']:>14} "
              f"{row['ingress_mb_per_s_per_master']:>15}")  # fmt: skip


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rollouts", type=int, default=10_000, help="rollouts spread over 3 masters")
    ap.add_argument("--group-size", type=int, default=8, help="samples per prompt (a slot)")
    ap.add_argument("--rounds", type=int, default=2, help="checkpoints of every rollout")
    ap.add_argument("--n1-rollouts", type=int, default=N1_ROLLOUTS,
                    help="rollouts of the groups-of-1 side (0: none)")  # fmt: skip
    ap.add_argument("--n1-rounds", type=int, default=2, help="its checkpoints of every rollout")
    ap.add_argument("--lease-workers", type=int, default=FLEET,
                    help="workers x 128 leases of the lease-index side (0: none)")  # fmt: skip
    ap.add_argument("--lease-rounds", type=int, default=2, help="its heartbeats per worker")
    ap.add_argument("--commit", type=int, default=256, help="rollouts per group commit")
    ap.add_argument("--commits", type=int, default=5, help="commits counted per cluster size")
    ap.add_argument("--ack-rounds", type=int, default=20, help="commits per replica-ack side")
    ap.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 3, 6],
                    help="masters of the round-trip clusters")  # fmt: skip
    ap.add_argument("--replicas", type=int, default=1, help="replicas per master (3 masters)")
    ap.add_argument("--fsync", default="always", choices=["always", "everysec", "no"],
                    help="AOF appendfsync of every node (always: as the project's)")  # fmt: skip
    ap.add_argument("--usable", type=float, default=0.7, help="of a master's core, planned")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    return ap.parse_args(argv)


if __name__ == "__main__":
    arguments = parse()
    figures = asyncio.run(main(arguments))
    if arguments.json:
        print(json.dumps(figures))
    else:
        show(figures)
