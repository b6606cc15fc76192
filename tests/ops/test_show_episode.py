"""``rollouts show`` of an episode, on a real redis-server: its tool events in the timeline, then
its turns (token span, weight versions) and calls (name, arguments cut short, claims with
runner, outcome, seconds, the decision on a lost one, observation length), and how it ended;
the same in ``--json``. A plain rollout's output has none of it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from statemachine import EpisodeSpec, FinishReason, RolloutRequest, SamplingParams
from statemachine import harness_commands as hc
from statemachine.commands import NewTokens
from store.client import RolloutClient
from store.redis_server import RedisServer
from tests import factories as f
from tests.ops.test_ops_cli import cli
from tests.store.episode_play import Play, episode_request
from tests.store.trainer import finish

pytestmark = pytest.mark.redis_server

LONG = '{"path": "' + "a" * 80 + '"}'


async def _episode(url: str) -> None:
    client = RolloutClient(url)
    try:
        await client.submit([episode_request()], batch_id="ep")
        play = await Play.load(client.store, "ep.0.0")
        await play.turn(3, version=0, tool="calc")
        await play.claim("env1")
        await play.result(2, seconds=0.5)
        await play.turn(2, version=1, tool="edit", args=LONG)
        await play.claim("env1")
        await play.lose("lease of runner env1 expired")
        await play.claim("env2")
        await play.result(4, seconds=1.25)
        await play.turn(1, version=1, tool="send")
        await play.claim("env3")
        await play.lose("lease of runner env3 expired")  # restart: effect_unverified
        await client.submit([RolloutRequest(prompt_token_ids=(1, 2),
                                            sampling=SamplingParams(max_tokens=4))],
                            batch_id="plain")  # fmt: skip
        await finish(client.store, "plain.0.0")
    finally:
        await client.aclose()


async def test_show_draws_an_episodes_turns_and_calls(
    server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    await _episode(server.url)
    code, out, err = await cli(capsys, "show", "ep.0.0", "--redis", server.url)
    assert code == 0, err
    lines = out.splitlines()
    # The timeline names each tool event.
    assert any(line.endswith("attempt 1's turn ended at call call-1: calc {\"x\": 1} (3 tokens "
                             "sampled so far)") for line in lines)  # fmt: skip
    assert any(line.endswith("call call-2 claim 1 lost (lease of runner env1 expired), effect "
                             "unverified: the last result's revision restored, then run again")
               for line in lines)  # fmt: skip
    assert any(line.endswith("call call-2 claim 2: result, 4 observation tokens") for line in lines)
    start = next(i for i, line in enumerate(lines) if line.startswith("episode: "))
    section = lines[start : lines.index(lines[-1])]
    assert section[0] == (
        "episode: 3 turns, 3 tool calls; context 12 tokens (6 sampled, 6 observation); failed "
        "(effect_unverified): call-3 (send): runner lost, effect unverified; the tool declares "
        "restart"
    )
    assert section[1:] == [
        "  turn 0  tokens [0, 3)  3 sampled (v0: 3)",
        '    call call-1 calc {"x": 1}: result, 2 observation tokens at [3, 5), 0.50s',
        "      claim 1  runner env1  result    0.50s",
        "  turn 1  tokens [5, 7)  2 sampled (v1: 2)",
        '    call call-2 edit {"path": "' + "a" * 47 + "...: result, 4 observation tokens at "
        "[7, 11), 1.25s over 2 claims",
        "      claim 1  runner env1  lost      0.00s  lease of runner env1 expired; decided "
        "restore: the last result's revision restored, then run again",
        "      claim 2  runner env2  result    1.25s",
        "  turn 2  tokens [11, 12)  1 sampled (v1: 1)",
        '    call call-3 send {"x": 1}: failed, 0.00s',
        "      claim 1  runner env3  lost      0.00s  lease of runner env3 expired; decided "
        "restart: the episode failed (effect_unverified)",
    ]
    assert lines[-1].startswith("now: ended (failed)")

    code, out, _ = await cli(capsys, "show", "ep.0.0", "--json", "--redis", server.url)
    shown = json.loads(out)
    episode = shown["episode"]
    assert [(t["start"], t["end"], t["by_version"]) for t in episode["turns"]] == [
        (0, 3, {"0": 3}), (5, 7, {"1": 2}), (11, 12, {"1": 1})]  # fmt: skip
    assert (episode["context_tokens"], episode["observation_tokens"]) == (12, 6)
    assert episode["finish_reason"] is None and shown["status"] == "failed"
    edit = episode["tool_calls"][1]
    assert edit["arguments"] == LONG  # whole in JSON
    claims = [(k["runner_id"], k["outcome"], k["decision"], k["seconds"]) for k in edit["claims"]]
    assert claims == [("env1", "lost", "restore", 0.0), ("env2", "result", None, 1.25)]
    kinds = [e["kind"] for e in shown["entries"]]
    assert kinds.count("tool_requested") == 3 and kinds.count("tool_lost") == 2
    lost = next(e for e in shown["entries"] if e["kind"] == "tool_lost")
    assert (lost["call_id"], lost["claim"], lost["reason"]) == ("call-2", 1, "restore")


async def test_show_of_a_plain_rollout_has_no_episode_part(
    server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    await _episode(server.url)
    code, out, _ = await cli(capsys, "show", "plain.0.0", "--redis", server.url)
    assert code == 0 and "episode" not in out and "call" not in out
    code, out, _ = await cli(capsys, "show", "plain.0.0", "--json", "--redis", server.url)
    shown = json.loads(out)
    assert "episode" not in shown
    assert [e["kind"] for e in shown["entries"]] == [
        "submitted", "started", "checkpoints", "finished"]  # fmt: skip
    assert all(set(e) <= {"kind", "seq", "at", "until", "attempt", "worker_id", "weight_version",
                          "tokens", "checkpoints", "by_version", "reason", "detail"}
               for e in shown["entries"])  # fmt: skip


async def test_show_draws_a_harness_driven_episodes_turns_and_what_each_call_fed(
    server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    client = RolloutClient(server.url)
    try:
        request = RolloutRequest(prompt_token_ids=(1, 2), episode=EpisodeSpec(harness=True),
                                 sampling=SamplingParams(max_tokens=4))  # fmt: skip
        await client.submit([request], batch_id="h")
        s = await client.store.load("h.0.0")
        s = await client.store.append(s, f.started(s))
        s = await client.store.append_chain(s, hc.end_turn(s, FinishReason.STOP, 7,
                                                            tokens=_new(3)))  # fmt: skip
        fed = hc.request_turn(s, call_batch="call-2", observation_token_ids=np.array([9, 9]),
                              sampling=SamplingParams(max_tokens=4))  # fmt: skip
        s = await client.store.append(s, fed)
        s = await client.store.append(s, f.resumed(s))
        await client.store.append_chain(s, hc.end_turn(s, FinishReason.LENGTH, None,
                                                       tokens=_new(4)))  # fmt: skip
    finally:
        await client.aclose()
    code, out, err = await cli(capsys, "show", "h.0.0", "--redis", server.url)
    assert code == 0, err
    assert "    turn ended: stop (stop 7); the next call fed 2 tokens at [3, 5)" in out, out
    assert "    turn ended: length; no next call yet" in out, out


def _new(n: int) -> NewTokens:
    return NewTokens(token_ids=np.arange(10, 10 + n, dtype=np.int32),
                     logprobs=np.zeros(n, dtype=np.float32),
                     weight_versions=np.zeros(n, dtype=np.int64))  # fmt: skip
