"""Helpers of the call-durability tests: an API process that can be killed and restarted on
its port, a completions call's body, and the rollouts a call recorded (found through its
session)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from store.client import RolloutClient
from store.errors import RolloutNotFound
from store.redis_server import free_port
from tests.api.harness.conftest import REPO
from tests.api.test_process import api_command

PROMPT = [74, 289, 78, 81, 265, 273, 352]


@dataclass
class ApiProcess:
    """``rollouts api`` on a fixed port, so that a client's retry finds its restart."""

    url: str  # Redis
    log_dir: Path
    extra: tuple[str, ...] = ()
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def v1(self) -> str:
        return f"{self.base}/v1"

    @property
    def log(self) -> Path:
        return self.log_dir / f"api-{self.starts}.log"

    async def start(self) -> ApiProcess:
        self.starts += 1
        path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
        env = {**os.environ, "PYTHONPATH": path}
        env.pop("ROLLOUTS_API_TOKEN", None)
        command = api_command(self.url, self.port, *self.extra)
        out = self.log.open("wb")
        self.proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
        await self._healthy()
        return self

    async def _healthy(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as s:
            while time.monotonic() < deadline:
                assert self.proc is not None and self.proc.poll() is None, self.log.read_text()
                try:
                    async with s.get(f"{self.base}/healthz") as r:
                        if r.status == 200:
                            return
                except aiohttp.ClientConnectionError:
                    pass
                await asyncio.sleep(0.1)
        raise AssertionError(f"the API did not come up:\n{self.log.read_text()}")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def completion(max_tokens: int, **more: object) -> dict[str, object]:
    """A greedy completions body with a token-id prompt, as the ``openai`` client sends it."""
    return {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, **more}  # fmt: skip


async def session_rollouts(client: RolloutClient, session: str, calls: int = 1,
                           timeout: float = 60) -> list[str]:  # fmt: skip
    """The rollout ids of the session's calls, once it lists ``calls`` of them."""
    deadline = time.monotonic() + timeout
    while True:
        found = await client.session(session)
        if len(found) >= calls:
            return [r for c in found for r in c.ids]
        assert time.monotonic() < deadline, f"session {session} lists {len(found)} calls"
        await asyncio.sleep(0.02)


async def give_up_after(api: ApiProcess, body: dict[str, object], seconds: float) -> None:
    """Post ``body`` and drop the connection after ``seconds``, mid-call, as a caller that
    gives up does (its client's timeout)."""
    timeout = aiohttp.ClientTimeout(total=seconds)
    async with aiohttp.ClientSession() as http:
        try:
            async with http.post(f"{api.v1}/completions", json=body, timeout=timeout) as r:
                raise AssertionError(f"answered within {seconds} s: {r.status}")
        except TimeoutError:
            return


async def until_tokens(client: RolloutClient, rid: str, n: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if (await client.store.load(rid)).num_tokens >= n:
                return
        except RolloutNotFound:  # its batch is recorded a moment before its rollouts
            pass
        assert time.monotonic() < deadline, f"{rid} never reached {n} tokens"
        await asyncio.sleep(0.02)
