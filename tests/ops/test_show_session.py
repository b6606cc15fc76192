"""``rollouts show --session S``: a session's calls in order, as text and as JSON, on a real
redis-server; and its usage errors."""

from __future__ import annotations

import json

import pytest

from statemachine import RolloutRequest, SamplingParams
from store.client import RolloutClient
from store.redis_server import RedisServer
from tests.ops.test_ops_cli import cli, run_cli
from tests.store.trainer import finish

pytestmark = pytest.mark.redis_server


def request(first: int) -> RolloutRequest:
    return RolloutRequest(prompt_token_ids=(first, 2, 3), sampling=SamplingParams(max_tokens=4))


async def test_show_a_sessions_calls(
    server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    client = RolloutClient(server.url)
    try:
        await client.submit([request(1)], n=2, batch_id="turn-1", session="ep:7")
        await client.submit([request(2)], batch_id="turn-2", session="ep:7")
        await finish(client.store, "turn-1.0.0")
    finally:
        await client.aclose()
    code, out, err = await cli(capsys, "show", "--session", "ep:7", "--redis", server.url)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == "session 'ep:7': 2 call(s), in order"
    assert lines[1].split() == ["#", "CALL", "MADE", "ROLLOUTS"]
    assert lines[2].split()[:2] == ["0", "turn-1"]
    assert lines[2].endswith("turn-1.0.0 done, turn-1.0.1 pending")
    assert lines[3].split()[:2] == ["1", "turn-2"] and lines[3].endswith("turn-2.0.0 pending")
    code, out, _ = await cli(capsys, "show", "--session", "ep:7", "--redis", server.url, "--json")
    shown = json.loads(out)
    assert [(c["batch_id"], c["ids"], c["states"]) for c in shown["calls"]] == [
        ("turn-1", ["turn-1.0.0", "turn-1.0.1"], ["done", "pending"]),
        ("turn-2", ["turn-2.0.0"], ["pending"]),
    ]
    code, out, _ = await cli(capsys, "show", "--session", "nobody", "--redis", server.url)
    assert code == 0 and "no calls recorded" in out


def test_show_needs_a_rollout_or_a_session(server: RedisServer) -> None:
    for argv in (["show"], ["show", "r1", "--session", "s"],
                 ["show", "--session", "s", "--plot", "x.png"]):  # fmt: skip
        done = run_cli(*argv, "--redis", server.url)
        assert done.returncode == 2, (argv, done.stderr)
        assert done.stderr.startswith("rollouts show: error:") and "Traceback" not in done.stderr
