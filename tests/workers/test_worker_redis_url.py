"""A real worker process against a redis-server with a password: a bad password stops it in
seconds (before any engine loads), with one line that never shows the password; the URL may
come from a flag, a file or the environment, in that order."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from store.connection import URL_ENV
from store.redis_server import RedisServer

pytestmark = pytest.mark.redis_server

PASSWORD = "right-pw-5d1c"
WRONG = "wrong-pw-7f3a"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with RedisServer(tmp_path / "redis", config={"requirepass": PASSWORD}) as s:
        yield s


def url(server: RedisServer, password: str | None) -> str:
    auth = f":{password}@" if password else ""
    return f"redis://{auth}127.0.0.1:{server.port}/0"


def worker(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str, float]:
    """Run `rollouts worker --engine synthetic --burst ARGS`: exit code, stdout, stderr, seconds."""
    environ = {k: v for k, v in os.environ.items() if k != URL_ENV}
    cmd = [sys.executable, "-m", "workers.cli", "worker", "--engine", "synthetic", "--burst"]
    t0 = time.monotonic()
    done = subprocess.run(
        [*cmd, *args],
        env={**environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return done.returncode, done.stdout, done.stderr, time.monotonic() - t0


def assert_refused(code: int, out: str, err: str, seconds: float, *secrets: str) -> None:
    assert code == 2, err
    # "At once": not after retrying (a refused write or a lost connection is retried for
    # minutes). The bound is the process's start-up, imports included, on a loaded 2-core
    # machine: 6 s was seen there with CI beside other test sessions.
    assert seconds < 15.0
    assert "authentication failed" in err.lower()
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err  # one clear line
    for secret in secrets:
        assert secret not in out + err


@pytest.mark.parametrize("password", [WRONG, None], ids=["wrong-password", "no-password"])
def test_a_bad_password_stops_the_worker_at_once(server: RedisServer, password: str) -> None:
    code, out, err, seconds = worker("--redis", url(server, password))
    assert_refused(code, out, err, seconds, WRONG)


def test_a_bad_password_from_the_environment_or_a_file_is_never_shown(
    server: RedisServer, tmp_path: Path
) -> None:
    assert_refused(*worker(env={URL_ENV: url(server, WRONG)}), WRONG)
    secret = tmp_path / "redis-url"
    secret.write_text(url(server, WRONG) + "\n")
    # The file comes before the environment (which holds the right password here).
    code, out, err, seconds = worker(
        "--redis-url-file", str(secret), env={URL_ENV: url(server, PASSWORD)}
    )
    assert_refused(code, out, err, seconds, WRONG, PASSWORD)


def test_the_url_from_a_file_or_the_environment_reaches_the_worker(
    server: RedisServer, tmp_path: Path
) -> None:
    secret = tmp_path / "redis-url"
    secret.write_text(url(server, PASSWORD) + "\n")
    for args, env in [
        (("--redis-url-file", str(secret)), {URL_ENV: url(server, WRONG)}),
        ((), {URL_ENV: url(server, PASSWORD)}),
        (("--redis", url(server, PASSWORD), "--redis-url-file", str(tmp_path / "none")), {}),
    ]:
        code, out, err, _ = worker(*args, env=env)
        assert code == 0, err
        assert '"outcomes"' in out  # the worker ran and reported its (empty) burst
        assert PASSWORD not in out + err
        assert f"redis://:***@127.0.0.1:{server.port}/0" in err  # the log shows where, redacted


def test_an_unreadable_url_file_is_one_line(tmp_path: Path) -> None:
    code, _, err, _ = worker("--redis-url-file", str(tmp_path / "missing"))
    assert code == 2
    assert "redis url file" in err.lower() and "Traceback" not in err


def test_help_shows_every_default() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "workers.cli", "worker", "--help"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert URL_ENV in done.stdout
    assert "redis://127.0.0.1:6379/0" in done.stdout
    assert "--redis-url-file" in done.stdout
