"""Fixtures of the harness endpoints' tests: a real redis-server, real ``rollouts api``
processes (with and without ``--tokenizer``) and one real worker process on the CPU engine and
the tiny dense model, shared by a module's tests (each test uses keys of its own); and the
harness routes in-process (``aiohttp.test_utils``, ``make_harness``) over a real
redis-server, with a real worker process on the synthetic engine (``worker``) when a test
generates."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from store.api.app import make_app
from store.api.harness.call import Calls
from store.api.harness.served import ServedModel
from store.client import RolloutClient
from store.redis_server import RedisServer, free_port
from tests.api.test_process import api_command
from tests.workers.helpers import start_worker, stop

REPO = Path(__file__).resolve().parents[3]
# ChatML, the tiny tokenizer's special tokens: what a Qwen chat template does, in short.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass
class Api:
    base: str
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def v1(self) -> str:
        return f"{self.base}/v1"


def wait_healthy(api: Api, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert api.proc.poll() is None, api.log.read_text()
        try:
            with urllib.request.urlopen(f"{api.base}/healthz", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"the API did not come up:\n{api.log.read_text()}")


@pytest.fixture(scope="package")
def chat_tokenizer(tiny_dense_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's tokenizer with a chat template (it has none of its own)."""
    out = tmp_path_factory.mktemp("chat-tokenizer")
    for f in tiny_dense_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="package")
def harness_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("harness-redis"))
    server.start()
    yield server
    server.close()


StartApi = Callable[..., Api]


@pytest.fixture(scope="package")
def start_api(
    harness_redis: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[StartApi]:
    """``start_api(*args)``: a ``rollouts api`` process on the package's Redis, healthy."""
    started: list[Api] = []
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    env.pop("ROLLOUTS_API_TOKEN", None)

    def start(*extra: str) -> Api:
        port = free_port()
        log = tmp_path_factory.mktemp("api") / "api.log"
        proc = subprocess.Popen(api_command(harness_redis.url, port, *extra), env=env,
                                stdout=log.open("wb"), stderr=subprocess.STDOUT)  # fmt: skip
        api = Api(f"http://127.0.0.1:{port}", proc, log)
        started.append(api)
        wait_healthy(api)
        return api

    yield start
    stop(*(a.proc for a in started))


@pytest.fixture(scope="package")
def cpu_worker(
    harness_redis: RedisServer, tiny_dense_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[subprocess.Popen[bytes]]:
    log = tmp_path_factory.mktemp("worker") / "worker.log"
    worker = start_worker(harness_redis.url, tiny_dense_dir, "hw1", log, concurrency=4)
    yield worker
    stop(worker)


@pytest.fixture(scope="package")
def api(start_api: StartApi, chat_tokenizer: Path, cpu_worker: object) -> Api:
    """The API with the tiny model's tokenizer (text prompts, chat), a worker behind it."""
    return start_api("--tokenizer", str(chat_tokenizer))


@pytest.fixture(scope="package")
def bare_api(start_api: StartApi, cpu_worker: object) -> Api:
    """The API without a tokenizer: token ids in, token ids out."""
    return start_api()


MakeHarness = Callable[..., Awaitable[TestClient]]


@pytest.fixture
async def make_harness(api_redis: RedisServer, redis: object) -> AsyncIterator[MakeHarness]:
    opened: list[tuple[TestClient, RolloutClient]] = []

    async def make(tokenizer: object = None, **calls: object) -> TestClient:
        rc = RolloutClient(api_redis.url, tokenizer=tokenizer)
        served = calls.pop("served", ServedModel(max_model_len=64))
        app = make_app(rc, calls=Calls(rc, served=served, **calls))  # type: ignore[arg-type]
        tc = TestClient(TestServer(app))
        await tc.start_server()
        opened.append((tc, rc))
        return tc

    yield make
    for tc, rc in opened:
        await tc.close()
        await rc.aclose()


@pytest.fixture
def worker(
    api_redis: RedisServer, redis: object, tmp_path: Path
) -> Iterator[subprocess.Popen[bytes]]:
    """A worker process on the synthetic engine, serving the API's Redis."""
    proc = start_worker(api_redis.url, None, "hw1", tmp_path / "worker.log", concurrency=4)
    yield proc
    stop(proc)
