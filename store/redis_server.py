"""A throwaway ``redis-server`` on a free port with its own data directory.

Used by the tests that stop, restart or kill Redis, by the benchmarks, and by the demo when no
Redis URL is given. It never touches a shared server or its data directory.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from urllib.parse import quote

DURABLE = {"appendonly": "yes", "appendfsync": "always"}


def _resp(args: list[str]) -> bytes:
    """A command in RESP, so a password with spaces or CRLF in it cannot break the framing."""
    out = [f"*{len(args)}\r\n".encode()]
    for arg in args:
        data = arg.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    def __init__(
        self,
        data_dir: str | Path | None = None,
        *,
        port: int | None = None,
        config: dict[str, str] | None = None,
        binary: str = "redis-server",
    ) -> None:
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="dr-redis-"))
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.config = {**DURABLE, **(config or {})}
        self.binary = shutil.which(binary) or binary
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The server's URL, with its password when it has one (print it ``redact``ed)."""
        password = self.config.get("requirepass")
        auth = f":{quote(password, safe='')}@" if password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.data_dir),
            "--save",
            "",
            "--daemonize",
            "no",
            "--logfile",
            str(self.data_dir / "redis.log"),
        ]
        for key, value in self.config.items():
            args += [f"--{key}", value]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._wait_ready(timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                log = (self.data_dir / "redis.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {log}")
            try:
                if self._answers_ping():
                    return
            except OSError:
                # Not listening yet, or it closed the connection on us.
                pass
            time.sleep(0.05)
        raise TimeoutError(f"redis-server on port {self.port} not ready after {timeout}s")

    def _answers_ping(self) -> bool:
        """PING, after AUTH when the server has a password: a server with one answers a bare
        PING with -NOAUTH even while it is still loading its AOF, so that is no sign of life."""
        password = self.config.get("requirepass")
        commands = [["AUTH", password], ["PING"]] if password else [["PING"]]
        with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
            s.sendall(b"".join(_resp(c) for c in commands))
            replies = s.makefile("rb")
            last = b""
            for _ in commands:
                last = replies.readline()
        # -LOADING while it replays its AOF; -WRONGPASS if the AUTH failed.
        return last.startswith(b"+PONG")

    def stop(self, *, kill: bool = False, timeout: float = 10.0) -> None:
        """SIGTERM (Redis flushes its AOF and exits) or, with ``kill``, SIGKILL."""
        if self.proc is None:
            return
        if kill:
            self.proc.kill()
        else:
            self.proc.terminate()
        self.proc.wait(timeout)
        self.proc = None

    def restart(self, *, kill: bool = False) -> None:
        self.stop(kill=kill)
        self.start()

    def close(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
