"""What one harness call costs the API in Redis round trips and commands (issue 30, point 7:
our CPU per call is mostly per reply), counted on the API's own connections while a real
worker process on the synthetic engine serves the call against a real redis-server.

A round trip is one ``send_packed_command`` (a pipeline or a transaction is one; the
commands it carries are counted apart). The counts are asserted exactly, so a change that
adds a round trip to every call fails here.
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import redis.connection as sync_connection

from statemachine import RolloutRequest, SamplingParams
from store import defaults
from store.api.harness.call import Call, Calls
from store.cancel_safe import _CancelSafe
from store.client import RolloutClient
from store.redis_server import RedisServer

pytestmark = pytest.mark.redis_server
REQUEST = RolloutRequest(prompt_token_ids=(5, 6, 7), sampling=SamplingParams(max_tokens=4))

# The counts this code reaches (docs/harness-endpoints.md lists each round trip): the batch
# created (with the newest weight version read), its chunk recorded and enqueued, one blocking
# read of its completion stream, its result loaded. A session's call adds its index entry
# (which also reads the session's worker: affinity costs no round trip), and one look at the
# session (its calls, its turn index, whether the call is a retry): its calls are the turns of
# an episode (store/harness_turns.py). 8 and 9 before the round-trip cuts; 5 for a session's
# call before episodes. A later turn: the look, the episode loaded (the call's prompt is
# checked against its context), the index entry and the turn index entry (one transaction),
# the turn's record with its job, the stream, the load.
ROUND_TRIPS = 4
SESSION_ROUND_TRIPS = 6
TURN_ROUND_TRIPS = 6


def command_names(packed: bytes) -> list[str]:
    """The names of the commands in a packed RESP payload (arrays of bulk strings)."""
    names, i = [], 0
    while i < len(packed):
        assert packed[i : i + 1] == b"*", packed[i : i + 20]
        end = packed.index(b"\r\n", i)
        count, i = int(packed[i + 1 : end]), end + 2
        for k in range(count):
            end = packed.index(b"\r\n", i)
            size = int(packed[i + 1 : end])
            if k == 0:
                names.append(packed[end + 2 : end + 2 + size].decode().upper())
            i = end + 2 + size + 2
    return names


class Trips:
    """Every ``send_packed_command`` of this process's redis-py connections, sync and async."""

    def __init__(self) -> None:
        self.sent: list[list[str]] = []

    def note(self, command: Any) -> None:
        if isinstance(command, str):
            command = command.encode()
        if isinstance(command, bytes):
            command = [command]
        self.sent.append(command_names(b"".join(command)))

    @property
    def commands(self) -> list[str]:
        return [name for trip in self.sent for name in trip]


@contextlib.contextmanager
def counted(monkeypatch: pytest.MonkeyPatch) -> Iterator[Trips]:
    trips = Trips()
    sync_send = sync_connection.AbstractConnection.send_packed_command
    # The API's asyncio connections are store.cancel_safe's, which send their own way.
    async_send = _CancelSafe.send_packed_command

    def send(self: Any, command: Any, *args: Any, **kw: Any) -> Any:
        trips.note(command)
        return sync_send(self, command, *args, **kw)

    async def asend(self: Any, command: Any, *args: Any, **kw: Any) -> Any:
        trips.note(command)
        return await async_send(self, command, *args, **kw)

    with monkeypatch.context() as m:
        m.setattr(sync_connection.AbstractConnection, "send_packed_command", send)
        m.setattr(_CancelSafe, "send_packed_command", asend)
        yield trips


@pytest.fixture
async def client(
    api_redis: RedisServer, worker: subprocess.Popen[bytes]
) -> AsyncIterator[RolloutClient]:
    c = RolloutClient(api_redis.url)
    # Every connection opened and every script cached: the first call pays for those.
    await Calls(c).run(Call("completions", REQUEST, session="warm", body=b"w"))
    await Calls(c).run(Call("completions", REQUEST))
    yield c
    await c.aclose()


async def one_call(client: RolloutClient, call: Call, monkeypatch: pytest.MonkeyPatch) -> Trips:
    # One blocking read of the completion stream whatever the machine's load (a quiet block
    # would add a read and a check for deleted rollouts).
    monkeypatch.setattr(defaults, "COMPLETION_BLOCK_MS", 60_000)
    with counted(monkeypatch) as trips:
        [result] = await Calls(client).run(call)
    assert len(result.response_token_ids) == 4
    return trips


async def test_a_session_less_call(client: RolloutClient, monkeypatch: pytest.MonkeyPatch) -> None:
    trips = await one_call(client, Call("completions", REQUEST), monkeypatch)
    assert len(trips.sent) == ROUND_TRIPS, trips.sent
    # Nothing looked up before the batch is created, no script probed before it runs, no head
    # read before the completion stream is.
    assert trips.sent[:3] == [["EVALSHA"], ["EVALSHA"], ["XREAD"]], trips.sent


async def test_a_session_call_costs_no_more(
    client: RolloutClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    call = Call("completions", REQUEST, session="ep", body=b"x")
    trips = await one_call(client, call, monkeypatch)
    assert len(trips.sent) == SESSION_ROUND_TRIPS, trips.sent
    assert trips.sent[0] == ["HGETALL", "EXISTS", "ZRANGE"], trips.sent
    assert trips.sent[1][0] == "MULTI" and trips.sent[2:5] == [["EVALSHA"], ["EVALSHA"], ["XREAD"]]
    assert [s.batch_id for s in await client.session("ep")] == [call.batch_id()]


async def test_a_sessions_next_turn_costs_as_many_and_records_only_its_new_tokens(
    client: RolloutClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    [first] = await Calls(client).run(Call("completions", REQUEST, session="ep2", body=b"1"))
    prompt = (*REQUEST.prompt_token_ids, *first.response_token_ids.tolist(), 9, 9)
    request = RolloutRequest(prompt_token_ids=prompt, sampling=REQUEST.sampling)
    call = Call("completions", request, session="ep2", body=b"2")
    trips = await one_call(client, call, monkeypatch)
    assert len(trips.sent) == TURN_ROUND_TRIPS, trips.sent
    assert trips.sent[0] == ["HGETALL", "EXISTS", "ZRANGE"], trips.sent
    # One rollout, whose second turn recorded the two tokens the call's prompt added.
    episode = await client.store.load(first.rollout_id)
    assert len(episode.calls) == 2 and episode.calls[0].result is not None
    assert episode.calls[0].result.observation_token_ids.tolist() == [9, 9]
    assert [s.batch_id for s in await client.session("ep2")][1] == call.batch_id()


async def test_a_retry_attaches_in_as_few(
    client: RolloutClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A retried call (its batch recorded) looks its rollouts up and writes nothing new."""
    call = Call("completions", REQUEST, key="k1")
    first = await one_call(client, call, monkeypatch)
    again = await one_call(client, call, monkeypatch)
    assert len(first.sent) == ROUND_TRIPS, first.sent
    assert "XRANGE" in again.commands and again.commands.count("EVALSHA") == 1, again.sent
