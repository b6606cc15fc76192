"""Making a real redis-server refuse writes, and letting it accept them again (issue 28).

Each condition is Redis's own, reached the way production reaches it, on a server the test
started (``store.redis_server.RedisServer``):

- ``oom``: ``maxmemory`` under what is used, with the default ``noeviction`` policy: every
  command that may grow memory is refused with ``OOM command not allowed``;
- ``misconf``: a failed RDB save (``dump.rdb`` is a non-empty directory, so the save cannot
  rename its file into place, as when the disk is full) with save points configured and
  ``stop-writes-on-bgsave-error yes`` (the default): writes, and PING, get ``MISCONF``;
- ``readonly``: the server made a replica (``REPLICAOF`` a primary of its own): writes get
  ``READONLY``, as on a replica the clients still point at after a failover.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path

from redis import Redis
from redis.exceptions import ResponseError

from store.redis_server import RedisServer

PROBE = "test:probe"  # never created: SET XX writes nothing, and is refused like any write
REFUSALS = ("oom", "misconf", "readonly")
Switch = Callable[[Redis, RedisServer], None]


def refusing(sync: Redis) -> bool:
    try:
        sync.set(PROBE, "", xx=True)
    except ResponseError:
        return True
    return False


def oom_on(sync: Redis, server: RedisServer) -> None:
    """``maxmemory`` just above what is used: the next writes cross it (as a filling Redis
    does), and from then on Redis refuses every command that may grow memory."""
    used = int(sync.info("memory")["used_memory"])
    sync.config_set("maxmemory", used + 32 * 1024)


def oom_hold(sync: Redis) -> None:
    """``maxmemory`` far under what is used: refused until lifted, however memory moves (a
    freed client buffer could otherwise let one write through)."""
    sync.config_set("maxmemory", 1)


def oom_off(sync: Redis, server: RedisServer) -> None:
    sync.config_set("maxmemory", 0)


def misconf_on(sync: Redis, server: RedisServer) -> None:
    sync.config_set("save", "3600 1")
    (server.data_dir / "dump.rdb" / "in-the-way").mkdir(parents=True, exist_ok=True)
    sync.bgsave()


def misconf_off(sync: Redis, server: RedisServer) -> None:
    shutil.rmtree(server.data_dir / "dump.rdb", ignore_errors=True)
    sync.bgsave()  # the next save succeeds: Redis accepts writes again


class Replica:
    """``readonly`` on and off: the server becomes the replica of a fresh primary of its own
    (its data replaced by the primary's: nothing), and is then promoted (a failover)."""

    def __init__(self, tmp_path: Path) -> None:
        self.dir = tmp_path / "primary"
        self.primary: RedisServer | None = None

    def on(self, sync: Redis, server: RedisServer) -> None:
        self.primary = RedisServer(self.dir).start()
        sync.replicaof("127.0.0.1", self.primary.port)
        deadline = time.monotonic() + 30
        while sync.info("replication").get("master_link_status") != "up":
            assert time.monotonic() < deadline, "the replica never linked to its primary"
            time.sleep(0.05)
        _settled(sync)

    def off(self, sync: Redis, server: RedisServer) -> None:
        sync.replicaof("NO", "ONE")
        if self.primary is not None:
            self.primary.close()
            self.primary = None
        _settled(sync)


def _settled(sync: Redis) -> None:
    """Until the AOF rewrite a replica starts after its sync is over: a SIGTERM meanwhile is
    ignored ("Writing initial AOF, can't exit"), and the test's server would never stop."""
    deadline = time.monotonic() + 30
    while True:
        info = sync.info("persistence")
        if not (info["aof_rewrite_in_progress"] or info["aof_rewrite_scheduled"]):
            return
        assert time.monotonic() < deadline, "the AOF rewrite never ended"
        time.sleep(0.05)


def conditions(tmp_path: Path) -> dict[str, tuple[Switch, Switch]]:
    """Each refusal's (on, off)."""
    replica = Replica(tmp_path)
    return {
        "oom": (oom_on, oom_off),
        "misconf": (misconf_on, misconf_off),
        "readonly": (replica.on, replica.off),
    }


def wait_refusing(sync: Redis, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not refusing(sync):
        assert time.monotonic() < deadline, "Redis never refused writes"
        time.sleep(0.02)


def wait_accepting(sync: Redis, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while refusing(sync):
        assert time.monotonic() < deadline, "Redis still refuses writes"
        time.sleep(0.02)
