"""The protocol every engine implements, and the values that cross it.

An engine takes token ids in and streams token ids out; it knows nothing of rollouts, Redis
or attempts. The worker owns durability; the engine only has to be honest about what it
produced (each token's logprob, its routed experts, the weights that sampled it) and to stop
producing for a request once told to.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from statemachine.arrays import smallest_route_dtype
from statemachine.request import SamplingParams
from statemachine.status import FinishReason


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineRequest:
    """One generation as the engine sees it.

    On a resume the caller passes `prompt + partial tokens` as `prompt_token_ids` and a
    `sampling` whose max_tokens/min_tokens are already reduced by the partial's length: the
    engine cannot tell a resume from a fresh request, and does not need to.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    # How many trailing ids of `prompt_token_ids` are the rollout's own earlier output (a
    # resume). Engines use it only so that a stop string straddling the resume point is seen.
    resumed_tokens: int = 0
    # Ask for the routed experts of prompt tokens [prompt_routes_from, len(prompt)) with the
    # first chunk (``Chunk.prompt_routes``), from the prefill the engine runs anyway; at least
    # 1 (token 0 has no forward before it). An episode's next turn asks for its observation's.
    # Engines that cannot (dense models, vLLM today, the synthetic engine) give none.
    prompt_routes_from: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Chunk:
    """Consecutive tokens of one request's stream (the CPU engine yields one per decode step).

    - `token_ids`: np.int32, shape [n].
    - `logprobs`: np.float32, shape [n]; the logprob of each sampled token under the *raw*
      model distribution (log_softmax of the logits before temperature, top-k/top-p or the
      min_tokens mask), as vLLM returns by default (`logprobs_mode="raw_logprobs"`). The
      trainer recomputes exactly this quantity, so it is the one worth comparing.
    - `routed_experts`: None for dense models; for MoE models an unsigned array
      [n, n_moe_layers, top_k] in the smallest dtype that holds the expert count (see
      `expert_dtype`). Row t is the routing of the forward pass that *produced* token t, i.e.
      of the input position just before it (the last prompt position for the first token).
      That is the routing under which the token's logprob was computed, it gives exactly one
      row per generated token without an extra forward, and it maps onto vLLM's per-input-
      position `routed_experts` as rows `[len(prompt) - 1 : len(prompt) - 1 + n]` (vLLM has no
      row for the last generated token, which this definition never needs).
    - `finish_reason`: set on the last chunk only; `stop_reason` is None (eos or length), the
      stop token id, or the stop string that ended generation.
    - `weight_version`: the weight version that sampled these tokens. A chunk never spans a
      weight swap, so a caller can tag every token exactly (invariant 4) even when weights
      change under an in-flight request.
    - `top_token_ids` (int32) and `top_logprobs` (float32), [n, k] for a request with
      `sampling.logprobs = k` >= 1, else None: vLLM's top-k at each position, the k most likely
      tokens under the same raw distribution as `logprobs`, most likely first (the sampled
      token is among them when it ranks within k; under greedy it is the first).
    - `prompt_routes`: on the request's first chunk only, for a request that set
      `prompt_routes_from` = f on an engine that can: [len(prompt) - f, n_moe_layers, top_k],
      the rows of prompt tokens f .. len(prompt) - 1 under the same convention (row i is the
      forward at input position f - 1 + i), from the prefill under `weight_version`'s weights.
      With `routed_experts`, whose first row is the forward at the last prompt position, every
      position from f - 1 on has exactly one row. None otherwise.
    """

    token_ids: np.ndarray
    logprobs: np.ndarray
    routed_experts: np.ndarray | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    weight_version: int = 0
    top_token_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None
    prompt_routes: np.ndarray | None = None


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Joined:
    """Consecutive chunks of one stream as single arrays (logprobs as the engine gave them)."""

    token_ids: np.ndarray  # int32 [n]
    logprobs: np.ndarray  # float32 [n]
    weight_versions: np.ndarray  # int64 [n], the version of each token's chunk
    routed_experts: np.ndarray | None  # [n, layers, top_k] or None (dense)
    top_token_ids: np.ndarray | None = None  # int32 [n, k] (logprobs=k), or None
    top_logprobs: np.ndarray | None = None  # float32 [n, k], or None
    prompt_routes: np.ndarray | None = None  # the stream's first chunk's, if these begin it


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class End:
    """How one request's stream ended within a ``Step``: a finish reason (its last tokens are
    in the same step), or the error its ``generate`` stream would have raised (``EngineError``
    and its kinds: ``RequestAborted``, ``RequestRejected``, ...)."""

    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    error: BaseException | None = None


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Step:
    """One engine step's output for every request added with ``StepEngine.add`` that produced
    tokens in it, as flat arrays (vLLM's engine core outputs and the CPU engine's decode rounds
    come this way): piece ``i`` is ``counts[i]`` consecutive tokens of ``request_ids[i]`` (one
    each when ``counts`` is None, vLLM's cadence), laid end to end in ``token_ids``,
    ``logprobs`` and ``routed_experts`` (as in ``Chunk``). A request appears at most once per
    step, and a step never spans a weight swap (``weight_version`` sampled all of it).
    ``ends``: the requests whose stream ended with this step (see ``End``).
    ``top_token_ids``/``top_logprobs``: [T, K] when some request of the step asked for top-k
    logprobs, K at least the widest k asked: a request with ``logprobs = k`` takes the first k
    columns of its rows (each row most likely first, so these are its top-k); the rest of a
    row, and the rows of requests that asked for none, mean nothing. None when none asked.
    ``prompt_routes``: by request id, the ``Chunk.prompt_routes`` of the requests whose first
    token is in this step and that got them; None (most steps) when there are none."""

    request_ids: Sequence[str]
    token_ids: np.ndarray  # int32 [T]
    logprobs: np.ndarray  # float32 [T]
    counts: np.ndarray | None = None  # int [len(request_ids)], summing to T; None: all 1
    routed_experts: np.ndarray | None = None  # [T, layers, top_k] or None (dense)
    weight_version: int = 0
    ends: Mapping[str, End] = field(default_factory=dict)
    top_token_ids: np.ndarray | None = None  # int32 [T, K]
    top_logprobs: np.ndarray | None = None  # float32 [T, K]
    prompt_routes: Mapping[str, np.ndarray] | None = None

    @classmethod
    def only_ends(cls, ends: Mapping[str, End]) -> Step:
        """A step without tokens that only ends streams."""
        return cls(
            request_ids=[],
            token_ids=np.empty(0, dtype=np.int32),
            logprobs=np.empty(0, dtype=np.float32),
            ends=ends,
        )


class Tokens(Protocol):
    """Any piece of a stream with per-token arrays: a `Chunk`, or a vLLM server's answer."""

    @property
    def token_ids(self) -> np.ndarray: ...

    @property
    def logprobs(self) -> np.ndarray: ...


def join_tokens(pieces: Sequence[Tokens]) -> tuple[np.ndarray, np.ndarray]:
    """Token ids (int32) and logprobs (float32) of ``pieces`` (at least one), in order."""
    return (
        np.concatenate([p.token_ids for p in pieces]).astype(np.int32, copy=False),
        np.concatenate([p.logprobs for p in pieces]).astype(np.float32, copy=False),
    )


def join_chunks(chunks: Sequence[Chunk]) -> Joined:
    """One ``Joined`` of ``chunks`` (at least one), in order."""
    token_ids, logprobs = join_tokens(chunks)
    routes = [c.routed_experts for c in chunks]
    top = chunks[0].top_token_ids is not None
    return Joined(
        token_ids=token_ids,
        logprobs=logprobs,
        weight_versions=np.concatenate(
            [np.full(len(c.token_ids), c.weight_version, dtype=np.int64) for c in chunks]
        ),
        routed_experts=None if routes[0] is None else np.concatenate(routes),  # type: ignore[arg-type]
        top_token_ids=np.concatenate([c.top_token_ids for c in chunks]) if top else None,
        top_logprobs=np.concatenate([c.top_logprobs for c in chunks]) if top else None,
        prompt_routes=chunks[0].prompt_routes,
    )


def expert_dtype(num_experts: int) -> np.dtype:
    """The smallest unsigned integer dtype that holds every expert index (uint8 below 256):
    the one the events store routes in (``statemachine.arrays.smallest_route_dtype``)."""
    return smallest_route_dtype(num_experts - 1)


def config_expert_dtype(config: Mapping[str, Any]) -> np.dtype | None:
    """``expert_dtype`` of a model's ``config.json`` (as a mapping); None for a dense model.

    The expert count is ``num_experts`` (Qwen-MoE) or ``num_local_experts`` (Mixtral;
    transformers 5 writes it for Qwen-MoE too).
    """
    n = config.get("num_experts") or config.get("num_local_experts")
    return expert_dtype(int(n)) if n else None


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """What an engine can serve, for the checks every request passes before it is sent
    (``workers.engines.inflight.check_request``). None: unknown (e.g. vLLM servers whose model
    directory is not mounted here); the engine itself is then the only judge."""

    context_length: int | None  # prompt + generated tokens, at most (vLLM's max_model_len)
    vocab_size: int | None  # token ids are 0 .. vocab_size - 1


@runtime_checkable
class Engine(Protocol):
    """What a worker needs of an engine.

    Contract (tests/engines/test_engine_contract.py holds every engine to it):
    - `generate` raises `RequestRejected` for a request it can never serve (see `limits`).
    - `generate` streams chunks; the last one carries a finish reason and the stream then
      ends. An aborted request's stream raises `workers.engines.errors.RequestAborted`
      instead, so a stream that ends quietly always ended with a finish reason.
    - `abort` is idempotent, accepts unknown ids, and once it returns no further chunk of that
      request is yielded (late outputs are dropped).
    - `load_weights` loads a checkpoint directory of the same architecture in place at a safe
      point between decode steps; requests in flight continue under the new weights (their
      KV cache is recomputed), and `weight_version` changes only once the load is complete.
    """

    @property
    def weight_version(self) -> int: ...

    @property
    def limits(self) -> EngineLimits:
        """Its context length and vocabulary size, where known."""
        ...

    @property
    def model_id(self) -> str:
        """Which model this engine runs (``workers.engines.identity``); "" if unknown."""
        ...

    def generate(self, request: EngineRequest) -> AsyncIterator[Chunk]: ...

    async def abort(self, request_id: str) -> None: ...

    async def load_weights(self, source: str, version: int) -> None: ...

    async def close(self) -> None: ...


@runtime_checkable
class StepEngine(Protocol):
    """An engine that can also hand over one step for all its requests at once.

    On a GPU, vLLM streams one token per request per engine step for hundreds of requests; one
    async iterator step per token per request (``generate``) costs the worker several times
    what recording the token does. A ``StepEngine`` gives the worker each step whole instead
    (``workers.stepper`` consumes it in one loop). Contract (tests/engines/test_steps.py):
    - ``add`` admits a request as ``generate`` would (the same refusals, raised here; an id
      aborted before it came raises ``RequestAborted``) and its tokens then come in ``steps``,
      with exactly the tokens, logprobs, routes and versions ``generate`` would have yielded;
    - ``steps`` yields steps while requests added with ``add`` are in flight and returns once
      none is; one consumer at a time; it raises ``EngineDead`` if the engine died;
    - ``abort`` (the ``Engine`` one) works on these requests too: once it returns, no piece of
      the request comes any more, and its end (``RequestAborted``) may still be reported.
    """

    async def add(self, request: EngineRequest) -> None: ...

    def steps(self) -> AsyncIterator[Step]: ...

    async def abort(self, request_id: str) -> None: ...
