"""What every real engine keeps about the requests it streams, written once.

The CPU engine and both vLLM engines (not the synthetic one, a test double) each have:
- a table of the requests in flight by request id (`in_flight` lists it);
- the same admission checks, before anything reaches the model: no work once the engine is
  closed (EngineClosed), no second request under an id still in flight, and a prompt that is
  non-empty, inside the vocabulary and shorter than the context (`check_prompt`);
- the same abort: idempotent (unknown, finished and already-aborted ids are accepted), it
  marks the stream aborted at once, so that nothing more is yielded from it, and then stops
  whatever the engine runs for the request (`_stop`, each engine's own). An abort that comes
  before its request was registered (the worker stops an attempt it is still opening) is
  remembered, and that request's `generate` raises RequestAborted without running: before,
  such a stop was lost and the rollout ran to its end on old weights, or through a shutdown.
  Ids that ended recently are remembered too, so an abort after a finish stays a no-op and the
  id can be used again;
- the same properties: weight version, model identity and the source of the weights.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Generic, TypeVar

from workers.engines.base import EngineRequest
from workers.engines.errors import EngineClosed, EngineError, RequestAborted

# How many ended and early-aborted request ids an engine remembers (a few hundred bytes
# each): far more than the requests a worker opens in the moments such a race spans.
REMEMBERED_IDS = 4096


@dataclass(eq=False, kw_only=True)
class Stream:
    """One request's stream as its engine tracks it; each engine adds its own fields."""

    aborted: bool = False


S = TypeVar("S", bound=Stream)


class InFlightEngine(Generic[S]):
    """Base of the real engines (see the module docstring); `S` is the engine's stream type."""

    def __init__(self, *, weight_version: int, source: str | None, model_id: str = "") -> None:
        self._weight_version = weight_version
        self._source = source
        self._model_id = model_id
        self._streams: dict[str, S] = {}
        self._closed = False
        self._ended: OrderedDict[str, None] = OrderedDict()  # recent ids whose stream ended
        self._aborted_early: OrderedDict[str, None] = OrderedDict()  # aborted before generate

    @property
    def weight_version(self) -> int:
        return self._weight_version

    @property
    def model_id(self) -> str:
        """The model's identity (``workers.engines.identity``), recorded by every attempt;
        "" if unknown (no check against other attempts)."""
        return self._model_id

    @property
    def source(self) -> str | None:
        """The checkpoint directory the weights were last loaded from (None: the weights the
        vLLM servers started with, for vllm-http before its first load)."""
        return self._source

    @property
    def in_flight(self) -> list[str]:
        """Ids of the requests currently streaming."""
        return list(self._streams)

    async def abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is None:
            if request_id not in self._ended:
                # Not registered yet: its generate() must not run (see the module docstring).
                _remember(self._aborted_early, request_id)
            return  # finished or already aborted: abort is idempotent
        stream.aborted = True  # from here on the stream yields nothing more
        _remember(self._ended, request_id)
        await self._stop(stream)

    async def _stop(self, stream: S) -> None:
        """Stop what the engine runs for an aborted stream (wake it, free its slot)."""
        raise NotImplementedError

    def _raise_if_closed(self) -> None:
        if self._closed:
            raise EngineClosed("engine is closed")

    def _check_new(self, request_id: str) -> None:
        """Refuse a request on a closed engine, or under an id that is still in flight; end
        one that was aborted before it got here."""
        self._raise_if_closed()
        if request_id in self._streams:
            raise EngineError(f"request id {request_id!r} is already in flight")
        if request_id in self._aborted_early:
            del self._aborted_early[request_id]
            raise RequestAborted(f"request {request_id!r} was aborted before it started")
        self._ended.pop(request_id, None)  # a reused id: a new stream from here on

    def _track(self, request_id: str, stream: S) -> None:
        self._streams[request_id] = stream

    def _untrack(self, request_id: str, stream: S) -> None:
        """Forget a stream that ended, unless abort() already did (the id may be reused)."""
        if self._streams.get(request_id) is stream:
            del self._streams[request_id]
            _remember(self._ended, request_id)


def _remember(ids: OrderedDict[str, None], request_id: str) -> None:
    ids[request_id] = None
    ids.move_to_end(request_id)
    while len(ids) > REMEMBERED_IDS:
        ids.popitem(last=False)


def check_prompt(
    request: EngineRequest, *, vocab_size: int, max_len: int, max_len_name: str = "max_model_len"
) -> None:
    """Refuse a bad prompt before it reaches the model, with the same errors on every engine
    (`max_len_name` names the limit as the engine's configuration does)."""
    ids = request.prompt_token_ids
    if not ids:
        raise EngineError("prompt_token_ids must not be empty")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise EngineError(f"prompt token ids outside the vocabulary (size {vocab_size}): {bad[:5]}")
    if len(ids) >= max_len:
        raise EngineError(
            f"prompt of {len(ids)} tokens leaves no room within {max_len_name}={max_len}"
        )
