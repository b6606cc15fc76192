"""What every real engine keeps about the requests it streams, written once.

The CPU engine and both vLLM engines (not the synthetic one, a test double) each have:
- a table of the requests in flight by request id (`in_flight` lists it);
- the same admission checks, before anything reaches the model: no work once the engine is
  closed (EngineClosed), no second request under an id still in flight, and a request the
  model can serve (`check_request`: prompt and stop ids inside the vocabulary, prompt shorter
  than the context, prompt + max_tokens within it unless capped), else RequestRejected;
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
from dataclasses import dataclass, replace
from typing import Generic, TypeVar

from statemachine import RolloutState
from workers.engines.base import EngineLimits, EngineRequest
from workers.engines.errors import EngineClosed, EngineError, RequestAborted, RequestRejected

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


def check_request(request: EngineRequest, limits: EngineLimits, *, context_name: str) -> None:
    """Refuse, with ``RequestRejected``, a request the engine can never serve, before anything
    reaches the model; the same checks and messages on every engine (``context_name`` names the
    limit as the engine's configuration does). Run by the worker before it asks the engine
    (so the synthetic engine is held to them too) and by each real engine's ``generate``.

    A resume is checked like a fresh request: its prompt is ``prompt + tokens so far`` and its
    budget the tokens left, so the total is unchanged."""
    ids = request.prompt_token_ids
    sampling = request.sampling
    if not ids:
        raise RequestRejected("prompt_token_ids must not be empty")
    start = request.prompt_routes_from
    if start is not None and not 1 <= start < len(ids):
        # Row f is the forward at position f - 1: token 0 has none, and at least one row.
        raise RequestRejected(
            f"prompt_routes_from {start} is outside 1 .. {len(ids) - 1} (the prompt has "
            f"{len(ids)} tokens)"
        )
    vocab = limits.vocab_size
    if vocab is not None:
        for name, given in (("prompt", ids), ("stop_token_ids", sampling.stop_token_ids)):
            bad = [t for t in given if not 0 <= t < vocab]
            if bad:
                raise RequestRejected(
                    f"{name} token ids outside the vocabulary (size {vocab}): {bad[:5]}"
                )
    context = limits.context_length
    if context is None:
        return
    if len(ids) >= context:
        what = "prompt + tokens so far" if request.resumed_tokens else "prompt"
        raise RequestRejected(
            f"{what} of {len(ids)} tokens leaves no room within {context_name}={context}"
        )
    if len(ids) + sampling.max_tokens > context and not sampling.cap_to_context:
        raise RequestRejected(
            f"prompt of {len(ids)} tokens + max_tokens {sampling.max_tokens} exceeds "
            f"{context_name}={context} (set cap_to_context=True to generate what fits)"
        )


def context_full(state: RolloutState, limits: EngineLimits) -> bool:
    """A ``cap_to_context`` rollout whose saved tokens already fill the context: it ended by
    length when its last token fitted (only its finish was not recorded before an abort), so
    it is finished, not refused as a request the engine cannot serve."""
    context = limits.context_length
    return (
        context is not None
        and state.request.sampling.cap_to_context
        and state.num_tokens > 0
        and len(state.request.prompt_token_ids) + state.context_tokens >= context
    )


def fit_to_context(request: EngineRequest, limits: EngineLimits) -> EngineRequest:
    """``request`` with its token budget cut to what the context leaves, if it asked for that
    (``cap_to_context``); a capped rollout then ends with ``length`` where the context ends."""
    sampling = request.sampling
    context = limits.context_length
    if context is None or not sampling.cap_to_context:
        return request
    room = context - len(request.prompt_token_ids)
    if sampling.max_tokens <= room:
        return request
    capped = replace(sampling, max_tokens=room, min_tokens=min(sampling.min_tokens, room))
    return replace(request, sampling=capped)
