"""The processes bench_harness.py measures, and the CPU each of them spends.

(a) a vLLM server (``vllm serve``'s own launcher, OpenAI routes, the tiny MoE, float32), called
    directly; (b) ``rollouts api`` + one ``rollouts worker --engine vllm`` (in-process vLLM with
    the same engine arguments); (c) ``rollouts api`` + one ``rollouts worker --engine synthetic``
    (no model: the tokens cost nothing, so what the calls cost is ours). (b) and (c) each have
    an API process of their own on a queue of their own, so neither worker takes the other's
    calls and each API's CPU is its side's alone; they share one redis-server (AOF ``always``),
    whose CPU is read per side too (the sides never run at once).

CPU is read from ``/proc/<pid>/stat`` (utime + stime) before and after each round.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import aiohttp
from bench_api import ApiProcess

from store.redis_server import free_port
from workers.engine_factory import SYNTHETIC_ARGS_ENV, VLLM_ARGS_ENV
from workers.worker_cli import command as worker_command

ROOT = Path(__file__).resolve().parent.parent
TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
MAX_MODEL_LEN = 512
KV_CACHE_BYTES = 256 << 20  # the worker's own CPU default (workers/engines/vllm/local.py)
START_TIMEOUT_S = 600.0  # two vLLM engines starting on 2 shared cores: minutes, not seconds


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) ``pid`` has spent so far; 0 once it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    # The command name (field 2) may hold spaces: split after its closing parenthesis.
    fields = raw[raw.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) * TICK_S  # fields 14 and 15 of proc(5)


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (vLLM's engine core and its worker), found through the
    kernel's per-thread children lists."""
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                kids = Path(f"/proc/{p}/task/{tid}/children").read_text().split()
            except OSError:
                continue
            for k in map(int, kids):
                out.append(k)
                todo.append(k)
    return out


def total_cpu_s(pids: Iterable[int]) -> float:
    return sum(cpu_s(p) for p in pids)


class VllmServer:
    """``vllm serve`` (its module, ``vllm.entrypoints.launchers.api_server.entry``) on a free
    port: the server a harness calls today. Its engine arguments are the worker's (float32,
    eager, seed 0, prefix caching, the same KV cache and context), so (a) and (b) run the same
    engine; only what stands between the caller and it differs."""

    def __init__(self, model: Path, log: Path) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry",
            "--model", str(model), "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", "float32", "--enforce-eager", "--seed", "0", "--enable-prefix-caching",
            "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory-bytes", str(KV_CACHE_BYTES),
            "--disable-log-stats", "--disable-uvicorn-access-log",
        ]  # fmt: skip
        self._out = log.open("wb")
        # Its own process group: stop() reaches the engine core and its worker too.
        self.proc = subprocess.Popen(cmd, stdout=self._out, stderr=subprocess.STDOUT,
                                     start_new_session=True)  # fmt: skip

    async def up(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        async with aiohttp.ClientSession() as s:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the vLLM server exited: {self.log.read_text()[-3000:]}")
                try:
                    async with s.get(f"{self.base}/health") as r:
                        if r.status == 200:
                            return
                except aiohttp.ClientConnectionError:
                    pass  # not listening yet
                await asyncio.sleep(0.5)
        raise TimeoutError(f"the vLLM server did not start; see {self.log}")

    def stop(self) -> None:
        _stop_group(self.proc)
        self._out.close()


class Durable:
    """One ``rollouts api`` and one ``rollouts worker`` taking that API's calls from a queue of
    their own."""

    def __init__(self, name: str, redis_url: str, engine: str, model: Path | None, tmp: Path,
                 concurrency: int) -> None:  # fmt: skip
        queue = f"bench-{name}"
        self.name = name
        self.api = ApiProcess(redis_url, tmp / f"api-{name}.log", "--queue", queue)
        env = dict(os.environ, HF_HUB_OFFLINE="1")
        if engine == "vllm":
            # The server's engine arguments (VllmOptions' names: kv_cache_bytes, not vLLM's).
            env[VLLM_ARGS_ENV] = json.dumps(
                {"max_model_len": MAX_MODEL_LEN, "kv_cache_bytes": KV_CACHE_BYTES}
            )
        else:
            # Zero cost, one token per step as vLLM streams them, the tiny model's vocabulary.
            env[SYNTHETIC_ARGS_ENV] = json.dumps({"tokens_per_chunk": 1, "vocab": 2048})
        cmd = worker_command(redis_url, model or "", f"bench-{name}", "--queue", queue,
                             concurrency=concurrency, engine=engine)  # fmt: skip
        if model is None:
            i = cmd.index("--model")
            del cmd[i : i + 2]
        self.log = tmp / f"worker-{name}.log"
        self._out = self.log.open("wb")
        self.worker = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=self._out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip

    def stop(self) -> None:
        self.api.stop()
        _stop_group(self.worker, signal.SIGTERM)
        self._out.close()


def _stop_group(proc: subprocess.Popen[bytes], sig: signal.Signals = signal.SIGTERM) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, sig)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
