"""End to end: a real ``rollouts api`` process, a real redis-server and a real worker process
(synthetic engine): submit -> stream -> ack over HTTP, in JSON and in msgpack, with a token."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import msgpack
import pytest

from store.api.cli import configure
from store.client import RolloutClient
from store.redis_server import RedisServer, free_port
from tests.api.helpers import MSGPACK, array, msgpack_seq
from tests.workers.helpers import start_worker, stop

TOKEN = "e2e-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MAX_TOKENS = 24


def api_command(url: str, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "workers.cli", "api", "--redis", url, "--port", str(port),
            *extra]  # fmt: skip


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with RedisServer(tmp_path / "redis") as s:
        yield s


async def wait_healthy(
    base: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 30
) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            try:
                async with s.get(f"{base}/healthz") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientConnectionError:
                pass
            await asyncio.sleep(0.1)
    raise AssertionError(f"the API did not come up:\n{log.read_text()}")


def body(batch_id: str) -> dict[str, object]:
    return {"prompts": [{"prompt_token_ids": [11, 12, 13]}, {"prompt_token_ids": [14, 15]}],
            "n": 2, "sampling": {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True},
            "batch_id": batch_id}  # fmt: skip


@pytest.mark.slow  # two processes start (~6 s here)
async def test_submit_stream_ack_through_a_real_api_and_worker(
    server: RedisServer, tmp_path: Path
) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    api_log = tmp_path / "api.log"
    env = {**os.environ, "ROLLOUTS_API_TOKEN": TOKEN}
    api = subprocess.Popen(api_command(server.url, port, "--log-format", "json"), env=env,
                           stdout=api_log.open("wb"), stderr=subprocess.STDOUT)  # fmt: skip
    worker = start_worker(server.url, None, "w1", tmp_path / "worker.log", concurrency=4)
    trainer = RolloutClient(server.url)
    try:
        await wait_healthy(base, api, api_log)
        async with aiohttp.ClientSession(base_url=base) as http:
            async with http.get("/v1/stats") as r:
                assert r.status == 401  # the token from the environment is enforced

            await json_round(http, trainer)
            await msgpack_round(http)
    finally:
        await trainer.aclose()
        stop(worker)
        api.send_signal(signal.SIGTERM)
        code = api.wait(30)
    assert code == 0, api_log.read_text()
    log = api_log.read_text()
    assert TOKEN not in log
    events = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    submits = [e for e in events if e.get("event") == "submit"]
    assert [(e["batch_id"], e["rollouts"]) for e in submits] == [("json", 4), ("mp", 4)]
    assert [e["event"] for e in events].count("ack") == 2


async def json_round(http: aiohttp.ClientSession, trainer: RolloutClient) -> None:
    async with http.post("/v1/batches", json=body("json"), headers=AUTH) as r:
        assert r.status == 200, await r.text()
        ids = (await r.json())["ids"]
    async with http.get("/v1/batches/json/results", params={"timeout": "60"},
                        headers=AUTH) as r:  # fmt: skip
        assert r.content_type == "application/x-ndjson"
        lines = [json.loads(x) async for x in r.content if x.strip()]
    assert sorted(x["rollout_id"] for x in lines) == sorted(ids)
    mine = {x.rollout_id: x for x in await trainer.wait(ids)}
    for x in lines:
        assert x["status"] == "done" and x["position"]
        tokens = array(x["response_token_ids"])
        assert len(tokens) == MAX_TOKENS
        assert tokens.tolist() == mine[x["rollout_id"]].response_token_ids.tolist()
    async with http.post("/v1/ack", json={"batch_id": "json"}, headers=AUTH) as r:
        assert sorted((await r.json())["acked"]) == sorted(ids)


async def msgpack_round(http: aiohttp.ClientSession) -> None:
    mp = {**AUTH, "Content-Type": MSGPACK, "Accept": MSGPACK}
    async with http.post("/v1/batches", data=msgpack.packb(body("mp")), headers=mp) as r:
        assert r.content_type == MSGPACK
        ids = msgpack.unpackb(await r.read())["ids"]
    async with http.get("/v1/batches/mp/results", headers=mp) as r:
        results = msgpack_seq(await r.read())
    assert sorted(x["rollout_id"] for x in results) == sorted(ids)
    assert all(isinstance(x["logprobs"]["data"], bytes) for x in results)
    assert all(len(array(x["response_token_ids"])) == MAX_TOKENS for x in results)
    ack = msgpack.packb({"batch_id": "mp"})
    async with http.post("/v1/ack", data=ack, headers=mp) as r:
        assert sorted(msgpack.unpackb(await r.read())["acked"]) == sorted(ids)
    async with http.get("/v1/batches", headers=AUTH) as r:
        assert (await r.json()) == {"batches": []}


def test_bad_redis_url_is_one_line_and_exit_2() -> None:
    done = subprocess.run(api_command("foo://nowhere", free_port()), capture_output=True,
                          text=True, timeout=60, check=False)  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "Traceback" not in done.stderr
    assert done.stderr.startswith("rollouts api: error: invalid Redis URL")


@pytest.mark.slow  # the client's retries ride out ~15 s of outage before giving up
def test_unreachable_redis_is_one_line_and_exit_2() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    done = subprocess.run(api_command(url, free_port()), capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().count("\n") == 0 and "Traceback" not in done.stderr
    assert "cannot reach Redis" in done.stderr


def test_help_shows_every_default() -> None:
    parser = argparse.ArgumentParser()
    configure(parser)
    flags = [a for a in parser._actions if a.option_strings != ["-h", "--help"]]
    assert len(flags) >= 9  # every flag, however many there are, says its default
    for action in flags:
        assert action.help and "default" in action.help, action.option_strings
    done = subprocess.run([sys.executable, "-m", "workers.cli", "api", "--help"],
                          capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    assert "--max-body-bytes" in done.stdout
