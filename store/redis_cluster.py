"""A throwaway Redis Cluster on loopback: ``masters`` masters with ``replicas`` replicas each,
every node a ``redis-server`` of its own (``store.redis_server``) on a free port with its own
data directory, AOF with ``appendfsync always`` as every durable node here.

Used by the tests and benchmarks that run the store on a cluster (issue 32) and by whoever
wants one to try: ``with RedisCluster(Path("/tmp/c")) as c: print(c.url)``. Formed with
``redis-cli --cluster create`` (offline, on loopback: ~2 s to ``cluster_state:ok``), which
refuses fewer than 3 masters: 1 or 2 masters are formed by hand (``CLUSTER ADDSLOTSRANGE``,
``MEET``, ``REPLICATE``), so a benchmark can compare 1, 3 and 6. Then held until every replica
has synced with its master (``WAIT`` counts only synced replicas).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

from store.redis_server import RedisServer
from store.slots import SLOTS

# Each node's cluster bus listens on its port + 10000: ports are drawn below this so that the
# bus port exists, and both are checked free.
_BUS_OFFSET = 10_000
_MAX_PORT = 65_535 - _BUS_OFFSET


def _port_pair_free(port: int) -> bool:
    for p in (port, port + _BUS_OFFSET):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p))
            except OSError:
                return False
    return True


def cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too."""
    for _ in range(1000):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port <= _MAX_PORT and _port_pair_free(port):
            return port
    raise RuntimeError("no free port pair for a cluster node")


class RedisCluster:
    """``node_timeout_ms``: ``cluster-node-timeout`` (how long a master may be unreachable
    before its replica is promoted); ``config``: more settings for every node."""

    def __init__(
        self,
        data_dir: str | Path | None = None,
        *,
        masters: int = 3,
        replicas: int = 1,
        node_timeout_ms: int = 5000,
        config: dict[str, str] | None = None,
    ) -> None:
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="dr-cluster-"))
        self.masters = masters
        self.replicas = replicas
        settings = {
            "cluster-enabled": "yes",
            "cluster-config-file": "nodes.conf",
            "cluster-node-timeout": str(node_timeout_ms),
            # A replica's first sync starts at once rather than after the default 5 s wait.
            "repl-diskless-sync-delay": "0",
            **(config or {}),
        }
        self.nodes = [
            RedisServer(self.data_dir / f"node-{i}", port=cluster_port(), config=settings)
            for i in range(masters * (1 + replicas))
        ]

    @property
    def url(self) -> str:
        """``redis+cluster://host:port,host:port,...``: every node a seed (``store.connection``)."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self, timeout: float = 60.0) -> RedisCluster:
        for node in self.nodes:
            node.start()
        if self.masters < 3:
            self._form_by_hand(timeout)
        else:
            subprocess.run(
                ["redis-cli", "--cluster", "create",
                 *(f"127.0.0.1:{n.port}" for n in self.nodes),
                 "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                check=True, capture_output=True, timeout=timeout,
            )  # fmt: skip
        self.wait_ok(timeout)
        self.wait_synced(timeout)
        return self

    def _form_by_hand(self, timeout: float) -> None:
        """What ``--cluster create`` does, for the 1 or 2 masters it refuses: the first
        ``masters`` nodes share the slots evenly, every node meets the first, and each other
        node replicates a master (in turn)."""
        masters, others = self.nodes[: self.masters], self.nodes[self.masters :]
        for i, m in enumerate(masters):
            lo, hi = i * SLOTS // self.masters, (i + 1) * SLOTS // self.masters - 1
            self._ok(m.port, "CLUSTER", "ADDSLOTSRANGE", str(lo), str(hi))
        for n in self.nodes[1:]:
            self._ok(n.port, "CLUSTER", "MEET", "127.0.0.1", str(self.nodes[0].port))
        self._until(lambda: all(
            len(self.cli(n.port, "CLUSTER", "NODES").splitlines()) == len(self.nodes)
            for n in self.nodes
        ), timeout, "every node known to every node")  # fmt: skip
        for k, replica in enumerate(others):
            master_id = self.cli(masters[k % self.masters].port, "CLUSTER", "MYID").strip()
            self._ok(replica.port, "CLUSTER", "REPLICATE", master_id)

    def _ok(self, port: int, *args: str) -> None:
        # redis-cli exits 0 on an error reply when its output is not a terminal.
        out = self.cli(port, *args)
        if out.strip() != "OK":
            raise RuntimeError(f"{' '.join(args)} on {port}: {out.strip()}")

    def cli(self, port: int, *args: str, timeout: float = 10.0) -> str:
        """``redis-cli -p port args``: its output."""
        done = subprocess.run(
            ["redis-cli", "-p", str(port), *args],
            check=True, capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        return done.stdout

    def info(self, port: int, section: str) -> dict[str, str]:
        out: dict[str, str] = {}
        for line in self.cli(port, "INFO", section).splitlines():
            if ":" in line:
                key, _, value = line.partition(":")
                out[key.strip()] = value.strip()
        return out

    def wait_ok(self, timeout: float = 60.0) -> None:
        """Until every running node says ``cluster_state:ok``."""
        self._until(lambda: all(
            "cluster_state:ok" in self.cli(n.port, "CLUSTER", "INFO")
            for n in self.nodes if n.proc is not None
        ), timeout, "cluster_state:ok on every node")  # fmt: skip

    def wait_synced(self, timeout: float = 60.0) -> None:
        """Until every running replica's link to its master is up and synced."""

        def synced() -> bool:
            for n in self.nodes:
                if n.proc is None:
                    continue
                info = self.info(n.port, "replication")
                if info.get("role") == "slave" and (
                    info.get("master_link_status") != "up"
                    or info.get("master_sync_in_progress") != "0"
                ):
                    return False
            return True

        self._until(synced, timeout, "every replica synced")

    def wait_promoted(self, killed: int, timeout: float = 60.0) -> None:
        """Until a replica of the master on port ``killed`` (stopped) took its slots over:
        ``masters`` masters among the running nodes, and the cluster ok again."""
        self._until(lambda: len(self.master_ports()) == self.masters, timeout,
                    f"replica promoted for {killed}")  # fmt: skip
        self.wait_ok(timeout)

    def master_ports(self) -> list[int]:
        """The ports of the nodes that are masters now (a failover changes them)."""
        return [n.port for n in self.nodes if n.proc is not None
                and self.info(n.port, "replication").get("role") == "master"]  # fmt: skip

    def node(self, port: int) -> RedisServer:
        return next(n for n in self.nodes if n.port == port)

    @staticmethod
    def _until(check: object, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if check():  # type: ignore[operator]
                    return
            except (subprocess.CalledProcessError, OSError):
                pass  # a node restarting, or not listening yet: look again
            if time.monotonic() > deadline:
                raise TimeoutError(f"cluster: no {what} after {timeout}s")
            time.sleep(0.1)

    def close(self) -> None:
        for node in self.nodes:
            node.stop(kill=True)
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> RedisCluster:
        return self.start()

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
