"""The HTTP API (``rollouts api``, a process of its own) next to the Python client it wraps,
on one fresh redis-server (AOF ``appendfsync always``, started here on a free port).

- submit: the same 2,000 prompts of 64 token ids x n=4 (8,000 rollouts) submitted by
  ``RolloutClient.submit`` and by ``POST /v1/batches`` with a msgpack body and a JSON body
  (request objects and bodies built before the clock starts, as the trainer would have them;
  the HTTP side's time includes the response). Sides alternate, order reversed every other
  round, medians of ``--rounds`` rounds (this machine's speed drifts up to 2x within a minute,
  see ``side_by_side.py``). ``submit_ratio_*`` = client seconds / API seconds (1.0: as fast).
- stream: 2,000 rollouts of 256 tokens, completed beforehand by appending their events
  straight through the event store (no worker); each side reads all results in completion
  order from the start: ``client.results`` vs ``GET /v1/batches/{id}/results`` in NDJSON and
  in msgpack, the HTTP side decoding every line and its arrays back to numpy (what the trainer
  gets from the client). ``stream_ratio_*`` as above.
- ``api_ratio``: the lower of the two msgpack ratios (the issue's target: >= 0.5).
- added latency: 200 rollouts are completed one every 20 ms while a Python ``results()``
  consumer and an HTTP NDJSON consumer both follow the batch; per rollout, the HTTP arrival
  minus the Python arrival (same process, same clock). ``stream_added_p99_ms`` is its p99.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from watch import Watch

from statemachine import FinishReason, RolloutRequest, RolloutState, SamplingParams, commands
from statemachine.commands import NewTokens
from store.client import RolloutClient
from store.event_store import EventStore
from store.redis_server import RedisServer, free_port

ROOT = Path(__file__).resolve().parent.parent
PROMPT_TOKENS, GROUP = 64, 4
MSGPACK = "application/msgpack"


def requests(n: int, seed: int = 0) -> list[RolloutRequest]:
    rng = np.random.default_rng(seed)
    sampling = SamplingParams(max_tokens=1024, temperature=0.0, ignore_eos=True)
    return [
        RolloutRequest(
            prompt_token_ids=tuple(int(t) for t in rng.integers(10, 30_000, PROMPT_TOKENS)),
            sampling=sampling,
        )
        for _ in range(n)
    ]


def submit_body(reqs: list[RolloutRequest], batch_id: str) -> dict[str, Any]:
    return {
        "prompts": [{"prompt_token_ids": list(r.prompt_token_ids)} for r in reqs],
        "n": GROUP,
        "sampling": {"max_tokens": 1024, "temperature": 0.0, "ignore_eos": True},
        "batch_id": batch_id,
    }


class ApiProcess:
    def __init__(self, url: str, log: Path, *extra: str) -> None:
        """``extra``: more ``rollouts api`` flags (bench_harness.py's ``--queue``)."""
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self._log = log.open("wb")
        cmd = [sys.executable, "-m", "workers.cli", "api", "--redis", url,
               "--port", str(self.port), *extra]  # fmt: skip
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT)
        self.log = log

    async def up(self) -> None:
        deadline = time.monotonic() + 30
        async with aiohttp.ClientSession() as s:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(self.log.read_text())
                try:
                    async with s.get(f"{self.base}/healthz") as r:
                        if r.status == 200:
                            return
                except aiohttp.ClientConnectionError:
                    pass
                await asyncio.sleep(0.1)
        raise TimeoutError("the API did not start")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


def ratios(times: dict[str, list[float]], base: str) -> dict[str, float]:
    ref = statistics.median(times[base])
    return {k: round(ref / statistics.median(v), 4) for k, v in times.items() if k != base}


async def alternate(sides: dict[str, Callable[[int], Awaitable[float]]],
                    rounds: int) -> dict[str, list[float]]:  # fmt: skip
    times: dict[str, list[float]] = {k: [] for k in sides}
    names = list(sides)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            times[name].append(await sides[name](r))
    return times


# -- submit -------------------------------------------------------------------------------------
async def bench_submit(url: str, api: ApiProcess, http: aiohttp.ClientSession, prompts: int,
                       rounds: int) -> dict[str, Any]:  # fmt: skip
    client = RolloutClient(url)
    reqs = requests(prompts)
    bodies = {
        "json": lambda b: json.dumps(submit_body(reqs, b)).encode(),
        "msgpack": lambda b: msgpack.packb(submit_body(reqs, b)),
    }

    async def via_client(r: int) -> float:
        t0 = time.perf_counter()
        batch = await client.submit(reqs, n=GROUP, batch_id=f"client-{r}")
        elapsed = time.perf_counter() - t0
        assert len(batch) == prompts * GROUP
        await client.ack(batch_id=batch.batch_id)  # off the clock: keep Redis the same size
        await client.redis.delete("rq:queue:rollouts")
        return elapsed

    def via_api(kind: str) -> Callable[[int], Awaitable[float]]:
        async def side(r: int) -> float:
            batch_id = f"{kind}-{r}"
            data = bodies[kind](batch_id)
            ctype = MSGPACK if kind == "msgpack" else "application/json"
            t0 = time.perf_counter()
            async with http.post("/v1/batches", data=data, headers={
                    "Content-Type": ctype, "Accept": ctype}) as resp:  # fmt: skip
                raw = await resp.read()
                assert resp.status == 200, raw[:300]
            elapsed = time.perf_counter() - t0
            await client.ack(batch_id=batch_id)
            await client.redis.delete("rq:queue:rollouts")
            return elapsed

        return side

    try:
        times = await alternate(
            {"client": via_client, "msgpack": via_api("msgpack"), "json": via_api("json")}, rounds
        )
    finally:
        await client.aclose()
    n = prompts * GROUP
    r = ratios(times, "client")
    return {
        "submit_rollouts": n,
        "submit_body_bytes_json": len(bodies["json"]("x")),
        "submit_body_bytes_msgpack": len(bodies["msgpack"]("x")),
        "submit_client_per_s": round(n / statistics.median(times["client"]), 1),
        "submit_api_msgpack_per_s": round(n / statistics.median(times["msgpack"]), 1),
        "submit_api_json_per_s": round(n / statistics.median(times["json"]), 1),
        "submit_ratio_msgpack": r["msgpack"],
        "submit_ratio_json": r["json"],
    }


# -- completing rollouts without a worker -------------------------------------------------------
def tokens(n: int, rng: np.random.Generator) -> NewTokens:
    return NewTokens(
        token_ids=rng.integers(0, 150_000, n, dtype=np.int32),
        logprobs=rng.uniform(-10, 0, n).astype(np.float32),
        weight_versions=np.zeros(n, dtype=np.int64),
    )


async def begin(store: EventStore, ids: list[str]) -> list[RolloutState]:
    heads = [await store.head(rid) for rid in ids]
    chains = [(s, commands.begin(s, worker_id="bench", weight_version=0, weight_mode="abort",
                                 model="bench")) for s in heads]  # fmt: skip
    out = await store.append_many(chains)
    assert all(isinstance(s, RolloutState) for s in out), out[:1]
    return out  # type: ignore[return-value]


async def end(store: EventStore, states: list[RolloutState], n: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    chains = [(s, commands.finish(s, FinishReason.LENGTH, tokens=tokens(n, rng))) for s in states]
    out = await store.append_many(chains)
    assert all(isinstance(s, RolloutState) for s in out), out[:1]


# -- result streaming ---------------------------------------------------------------------------
def decode_json_result(line: bytes) -> dict[str, Any]:
    x: dict[str, Any] = json.loads(line)
    for k in ("response_token_ids", "logprobs", "weight_versions"):
        a = x[k]
        x[k] = np.frombuffer(base64.b64decode(a["data"]), dtype=a["dtype"])
    return x


def decode_msgpack_result(x: dict[str, Any]) -> dict[str, Any]:
    for k in ("response_token_ids", "logprobs", "weight_versions"):
        a = x[k]
        x[k] = np.frombuffer(a["data"], dtype=a["dtype"])
    return x


OnResult = Callable[[dict[str, Any]], None]


async def read_stream(http: aiohttp.ClientSession, batch_id: str, kind: str,
                      on_result: OnResult | None = None) -> int:  # fmt: skip
    headers = {"Accept": MSGPACK} if kind == "msgpack" else {}
    count = 0
    async with http.get(f"/v1/batches/{batch_id}/results", headers=headers,
                        params={"timeout": "120"}) as resp:  # fmt: skip
        assert resp.status == 200
        if kind == "msgpack":
            unpacker = msgpack.Unpacker(raw=False)
            async for chunk in resp.content.iter_any():
                unpacker.feed(chunk)
                for x in unpacker:
                    r = decode_msgpack_result(x)
                    count += 1
                    if on_result:
                        on_result(r)
        else:
            async for line in resp.content:
                if line.strip():
                    r = decode_json_result(line)
                    count += 1
                    if on_result:
                        on_result(r)
    return count


async def bench_stream(url: str, http: aiohttp.ClientSession, rollouts: int, n_tokens: int,
                       rounds: int) -> dict[str, Any]:  # fmt: skip
    client = RolloutClient(url)
    try:
        batch = await client.submit(requests(rollouts // GROUP, seed=1), n=GROUP,
                                    batch_id="stream")  # fmt: skip
        await end(client.store, await begin(client.store, list(batch)), n_tokens)

        async def via_client(_: int) -> float:
            t0 = time.perf_counter()
            got = [r async for r in client.results("stream", timeout=120)]
            elapsed = time.perf_counter() - t0
            assert len(got) == rollouts and len(got[0].response_token_ids) == n_tokens
            return elapsed

        def via_api(kind: str) -> Callable[[int], Awaitable[float]]:
            async def side(_: int) -> float:
                t0 = time.perf_counter()
                got = await read_stream(http, "stream", kind)
                elapsed = time.perf_counter() - t0
                assert got == rollouts
                return elapsed

            return side

        times = await alternate(
            {"client": via_client, "msgpack": via_api("msgpack"), "json": via_api("json")}, rounds
        )
        await client.ack(batch_id="stream")
    finally:
        await client.aclose()
    r = ratios(times, "client")
    return {
        "stream_rollouts": rollouts,
        "stream_tokens_each": n_tokens,
        "stream_client_per_s": round(rollouts / statistics.median(times["client"]), 1),
        "stream_api_msgpack_per_s": round(rollouts / statistics.median(times["msgpack"]), 1),
        "stream_api_json_per_s": round(rollouts / statistics.median(times["json"]), 1),
        "stream_ratio_msgpack": r["msgpack"],
        "stream_ratio_json": r["json"],
    }


async def bench_added_latency(url: str, http: aiohttp.ClientSession, rollouts: int,
                              every_s: float) -> dict[str, Any]:  # fmt: skip
    client = RolloutClient(url)
    try:
        batch = await client.submit(requests(rollouts, seed=2), n=1, batch_id="latency")
        states = await begin(client.store, list(batch))
        py_at: dict[str, float] = {}
        http_at: dict[str, float] = {}
        ended_at: dict[str, float] = {}

        async def python_side() -> None:
            async for r in client.results("latency", timeout=120):
                py_at[r.rollout_id] = time.perf_counter()

        def on_http(x: dict[str, Any]) -> None:
            http_at[x["rollout_id"]] = time.perf_counter()

        http_side = read_stream(http, "latency", "json", on_http)
        consumers = [asyncio.create_task(python_side()), asyncio.create_task(http_side)]
        await asyncio.sleep(0.5)  # both attached and blocked on the stream
        for s in states:
            ended_at[s.rollout_id] = time.perf_counter()
            await end(client.store, [s], 16)
            await asyncio.sleep(every_s)
        await asyncio.gather(*consumers)
        await client.ack(batch_id="latency")
    finally:
        await client.aclose()
    added = np.array([1000 * (http_at[k] - py_at[k]) for k in batch])
    py = np.array([1000 * (py_at[k] - ended_at[k]) for k in batch])
    via_http = np.array([1000 * (http_at[k] - ended_at[k]) for k in batch])
    return {
        "latency_rollouts": rollouts,
        "stream_added_p50_ms": round(float(np.percentile(added, 50)), 2),
        "stream_added_p99_ms": round(float(np.percentile(added, 99)), 2),
        "stream_python_p50_ms": round(float(np.percentile(py, 50)), 2),
        "stream_python_p99_ms": round(float(np.percentile(py, 99)), 2),
        "stream_http_p50_ms": round(float(np.percentile(via_http, 50)), 2),
        "stream_http_p99_ms": round(float(np.percentile(via_http, 99)), 2),
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    quick = args.quick
    with (
        tempfile.TemporaryDirectory(prefix="bench-api-") as tmp,
        RedisServer(Path(tmp) / "redis") as server,
    ):
        api = ApiProcess(server.url, Path(tmp) / "api.log")
        out: dict[str, Any] = {"quick": quick}
        t0 = time.perf_counter()
        try:
            async with Watch() as watch:
                watch.redis(server)
                watch.process(api.proc, "the API process", api.log)
                await api.up()
                connector = aiohttp.TCPConnector(limit=4)
                async with aiohttp.ClientSession(base_url=api.base, connector=connector) as http:
                    rounds = 2 if quick else args.rounds
                    out |= await bench_submit(server.url, api, http, 50 if quick else 2000, rounds)
                    out |= await bench_stream(server.url, http, 200 if quick else 2000,
                                              64 if quick else 256, rounds)  # fmt: skip
                    out |= await bench_added_latency(server.url, http, 40 if quick else 200, 0.02)
        finally:
            api.stop()
        out["api_ratio"] = min(out["submit_ratio_msgpack"], out["stream_ratio_msgpack"])
        out["api_ratio_json"] = min(out["submit_ratio_json"], out["stream_ratio_json"])
        out["cpus"] = os.cpu_count()
        out["bench_s"] = round(time.perf_counter() - t0, 1)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6, help="alternating rounds per side")
    ap.add_argument("--quick", action="store_true", help="a tiny workload (the smoke test's)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    a = ap.parse_args()
    result = asyncio.run(main(a))
    if a.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:40s} {v}")
