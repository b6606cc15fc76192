"""Real vLLM server processes on 127.0.0.1 for the tests (the launcher named in README).

Each server is our own child process on a free port with its own log file, stopped by its pid
(SIGTERM, then SIGKILL for its whole process group). Servers are pooled per model directory
for the session like the in-process engines (tests/engines/vllm_support.py): a start costs
30-60 s of CPU here.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections import OrderedDict
from pathlib import Path

import aiohttp

from workers.engines.vllm.ext import EXTENSION
from workers.engines.vllm.http import VllmHttpEngine
from workers.engines.vllm.http_pool import HttpOptions

MAX_MODEL_LEN = 512
START_TIMEOUT_S = 240.0  # 2 cores shared with the rest of the suite: be patient
# Fast failure detection for tests; the defaults suit production.
TEST_HTTP = HttpOptions(
    retries=3, backoff_s=0.05, backoff_max_s=0.5, probe_interval_s=0.2, read_timeout_s=60
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class VllmServer:
    def __init__(self, model_dir: Path, log_dir: Path, port: int | None = None) -> None:
        self.model_dir = Path(model_dir)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log_dir / f"vllm-server-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._held: socket.socket | None = None  # the port of a killed server (``kill``)

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "vllm.entrypoints.launchers.api_server.entry",
            "--model",
            str(self.model_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            "float32",
            "--enforce-eager",
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--kv-cache-memory-bytes",
            str(64 << 20),
            "--seed",
            "0",
            "--enable-scale-out",
            "--worker-extension-cls",
            EXTENSION,
            "--disable-log-stats",
        ]

    def start(self) -> VllmServer:
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", HF_HUB_OFFLINE="1")
        self.proc = subprocess.Popen(
            self.command(),
            stdout=self.log.open("ab"),
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # its own process group: stop() reaches its children
        )
        return self

    async def wait_healthy(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                if self.proc is not None and self.proc.poll() is not None:
                    raise RuntimeError(
                        f"vLLM server exited ({self.proc.returncode}); see {self.log}"
                    )
                try:
                    async with session.get(f"{self.url}/health") as resp:
                        if resp.status == 200:
                            return
                except aiohttp.ClientError:
                    pass  # not listening yet
                await asyncio.sleep(0.5)
        raise TimeoutError(f"vLLM server not healthy after {timeout} s; see {self.log}")

    def freeze(self) -> None:
        """SIGSTOP the server and its children: it generates nothing more, its sockets stay
        open (so a test can kill it mid-request however slowly the test itself runs)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGSTOP)

    def kill(self) -> None:
        """SIGKILL the server and its children at once (a crash, for the failover tests).
        Its port stays held, bound and not listening (refusing connections), until ``stop``:
        a process of another test that took the freed port would answer for the dead server
        (a CI run's pool found the killed one healthy again)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
            held = socket.socket()
            held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            held.bind(("127.0.0.1", self.port))
            self._held = held

    def stop(self) -> None:
        if self._held is not None:
            self._held.close()
            self._held = None
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)


class ServerPool:
    """At most `capacity` live servers, one per model directory, reused across tests."""

    def __init__(self, log_dir: Path, capacity: int = 3) -> None:
        self.log_dir = log_dir
        self.capacity = capacity
        self._servers: OrderedDict[str, VllmServer] = OrderedDict()
        self._engines: list[VllmHttpEngine] = []

    async def server(self, model_dir: Path) -> VllmServer:
        key = str(model_dir)
        server = self._servers.pop(key, None)
        if server is None or server.proc is None or server.proc.poll() is not None:
            while len(self._servers) >= self.capacity:
                _, old = self._servers.popitem(last=False)
                await asyncio.to_thread(old.stop)
            server = VllmServer(model_dir, self.log_dir).start()
            await server.wait_healthy()
        self._servers[key] = server
        return server

    async def get(self, model_dir: Path, weight_version: int = 0) -> VllmHttpEngine:
        """A fresh client on the server for `model_dir`, with its start-up weights."""
        server = await self.server(model_dir)
        # Earlier tests may have reloaded this server: put its own weights back first.
        probe = VllmHttpEngine([server.url], model_dir=model_dir, options=TEST_HTTP)
        await probe.load_weights(str(model_dir), weight_version)
        await probe.aclose()
        engine = VllmHttpEngine(
            [server.url],
            model_dir=model_dir,
            weight_version=weight_version,
            options=TEST_HTTP,
            max_model_len=MAX_MODEL_LEN,
        )
        self._engines.append(engine)
        return engine

    async def close(self) -> None:
        for engine in self._engines:
            await engine.aclose()
        while self._servers:
            _, server = self._servers.popitem()
            await asyncio.to_thread(server.stop)
