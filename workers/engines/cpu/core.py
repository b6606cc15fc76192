"""The CPU engine's core: the model and the decode loop over every request in flight.

Synchronous and single-threaded; `cpu.process` runs it in a process of its own and feeds it the
messages of `cpu.wire`. Each round applies pending weight loads, then advances every request
by one token (or by a slice of its prefill), round-robin, each with its own KV cache.

Why interleaving and not padded batched decoding: interleaved steps are exactly the
computation a request would get alone, so "same greedy tokens and bit-identical logprobs
whatever else is in flight" holds by construction; a padded batch changes the matmul shapes
and the attention mask, hence the float rounding. What that costs, measured on this 2-core
machine (shared, so +-30% run to run) with the tiny MoE model, transformers 5.24, torch 2.13:
raw one-token forwards give 320-540 tok/s for one sequence and 1100-1980 tok/s for a batch of
4 (3.5-4.8x, Python overhead dominates at this size); this engine gives 210-360 tok/s with 1
request in flight and 280-320 tok/s with 4 (interleaving keeps the total constant). The
engine is a correctness reference and a test double; vLLM batches for real.

Weight loads are applied between two rounds (a safe point: no forward is running). Every
in-flight request's KV cache, computed under the old weights, is then dropped and recomputed
from prompt + tokens generated so far on the new weights before its next token is sampled;
tokens after the swap carry the new version.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from statemachine.arrays import pack_array
from statemachine.request import SamplingParams
from workers.engines.cpu.model import CpuModel
from workers.engines.cpu.sampling import banned_tokens, sample, step_seed, top_logprobs
from workers.engines.cpu.stopping import StopChecker
from workers.engines.errors import EngineError

# Prompt tokens fed per request per round: bounds how long one new request's prefill delays
# the others' decode steps, an abort, or a weight load (~2.5 ms per token on the tiny MoE).
PREFILL_TOKENS_PER_ROUND = 64


@dataclass(eq=False)
class _Seq:
    """The core's state of one request."""

    serial: int
    sampling: SamplingParams
    stop: StopChecker
    base_seed: int
    tokens: list[int]
    n_prompt: int
    cache: Any = None
    n_cached: int = 0
    generator: torch.Generator = field(default_factory=torch.Generator)
    # Prompt routes asked for (``EngineRequest.prompt_routes_from``) until the first token is
    # sampled, and the rows its prefill has routed so far (one per forward from position
    # routes_from - 1 on): what the first chunk carries.
    routes_from: int | None = None
    prompt_routes: list[np.ndarray] = field(default_factory=list)


class EngineCore:
    """Turns `cpu.wire` messages into model work and output messages."""

    def __init__(self, model_dir: str | Path, *, weight_version: int = 0) -> None:
        self.model = CpuModel(model_dir)
        self.weight_version = weight_version
        self.closing = False
        self._active: list[_Seq] = []
        self._loads: list[tuple[int, str, int]] = []
        self._out: list[Any] = []  # messages for the front end, taken by `take_output`

    def ready_message(self) -> list[Any]:
        m = self.model
        return ["ready", {"vocab_size": m.vocab_size, "max_positions": m.max_positions,
                          "pid": os.getpid()}]  # fmt: skip

    @property
    def busy(self) -> bool:
        return bool(self._active or self._loads)

    def take_output(self) -> list[Any]:
        out, self._out = self._out, []
        return out

    # ---- input -----------------------------------------------------------------------

    def handle(self, message: list[Any]) -> None:
        kind = message[0]
        if kind == "add":
            _, serial, prompt, sampling, resumed, routes_from = message
            try:
                params = SamplingParams.from_dict(sampling)
                self._add(serial, prompt, params, resumed, routes_from)
            except Exception as exc:
                # A request the core cannot take (its sampling parameters, its stop settings)
                # fails alone, as the request's fault; the core and the rest go on.
                self._fail(serial, "RequestRejected", f"{type(exc).__name__}: {exc}")
        elif kind == "abort":
            # Anything it produced is dropped by the front end; here it only stops costing.
            self._active = [s for s in self._active if s.serial != message[1]]
        elif kind == "load":
            _, token, source, version = message
            self._loads.append((token, source, version))
        elif kind == "health":
            self._out.append(["health", message[1], len(self._active), self.weight_version])
        elif kind == "close":
            self.closing = True
            why = "engine closed while the request was in flight"
            for seq in self._active:
                self._fail(seq.serial, "EngineClosed", why)
            for token, _, _ in self._loads:
                self._out.append(["loaded", token, "EngineClosed", "engine closed before the load"])
            self._active, self._loads = [], []
        else:
            raise ValueError(f"unknown engine message {kind!r}")

    def _add(
        self,
        serial: int,
        prompt: list[int],
        sampling: SamplingParams,
        resumed: int,
        routes_from: int | None,
    ) -> None:
        stop = StopChecker(
            sampling,
            eos_token_ids=self.model.eos_token_ids,
            decode=self.model.decode,
            max_total_tokens=self.model.max_positions,
            prior=prompt[len(prompt) - resumed :] if resumed else (),
        )
        seed = sampling.seed if sampling.seed is not None else secrets.randbits(62)
        seq = _Seq(serial, sampling, stop, seed, list(prompt), len(prompt), routes_from=routes_from)
        self._active.append(seq)

    def _fail(self, serial: int, kind: str, message: str) -> None:
        self._out.append(["error", serial, kind, message])

    # ---- one round -------------------------------------------------------------------

    @torch.inference_mode()
    def round(self) -> None:
        """Apply pending loads, then advance each request by one token (or a prefill slice)."""
        loads, self._loads = self._loads, []
        for load in loads:
            self._apply_load(*load)
        still: list[_Seq] = []
        for seq in self._active:
            try:
                done = self._step(seq)
            except Exception as exc:
                # One request's failure (e.g. a forward error) must not stop the others.
                self._fail(seq.serial, "EngineError", f"{type(exc).__name__}: {exc}")
                done = True
            if not done:
                still.append(seq)
        self._active = still

    def _apply_load(self, token: int, source: str, version: int) -> None:
        try:
            self.model.swap_weights(source)
        except EngineError as exc:
            # A bad checkpoint fails only the load call; old weights and version stay.
            self._out.append(["loaded", token, type(exc).__name__, str(exc)])
            return
        self.weight_version = version
        for seq in self._active:
            # KV computed under the old weights is stale: recompute from scratch (and the
            # prompt routes with it: the first token's weights route them).
            seq.cache = None
            seq.n_cached = 0
            seq.prompt_routes = []
        self._out.append(["loaded", token, None, ""])

    def _step(self, seq: _Seq) -> bool:
        """Advance one request by one token (or by a slice of its prefill); True when done."""
        model = self.model
        if seq.cache is None:
            seq.cache = model.new_cache()
        last = len(seq.tokens) - 1
        budget = PREFILL_TOKENS_PER_ROUND
        # The prefill's routes are kept from this position on (``last``: none are asked).
        keep_from = last if seq.routes_from is None else seq.routes_from - 1
        while seq.n_cached < last and budget > 0:
            _, routing = model.forward(seq.tokens[seq.n_cached], seq.cache)
            if seq.n_cached >= keep_from and routing is not None:  # None: a dense model
                seq.prompt_routes.append(routing)
            seq.n_cached += 1
            budget -= 1
        if seq.n_cached < last:
            return False
        logits, routing = model.forward(seq.tokens[last], seq.cache)
        seq.n_cached += 1
        params = seq.sampling
        seq.generator.manual_seed(step_seed(seq.base_seed, len(seq.tokens)))
        token, logprob = sample(
            logits,
            params,
            banned=banned_tokens(
                params,
                n_generated=len(seq.tokens) - seq.n_prompt,
                eos_token_ids=model.eos_token_ids,
            ),
            generator=seq.generator,
        )
        seq.tokens.append(token)
        finish, stop_reason = seq.stop.check(seq.tokens[seq.n_prompt :], len(seq.tokens))
        routes = None if routing is None else pack_array(routing[None])
        prompt_routes = None
        if seq.routes_from is not None:  # the first token: its chunk carries them, once
            if seq.prompt_routes:
                prompt_routes = pack_array(np.stack(seq.prompt_routes))
            seq.routes_from, seq.prompt_routes = None, []
        # Top-k only when asked: the k=0 path computes nothing more than it did before.
        top = top_logprobs(logits, params.logprobs) if params.logprobs else None
        self._out.append(
            ["chunk", seq.serial, token, logprob, routes,
             None if finish is None else finish.value, stop_reason, self.weight_version, top,
             prompt_routes]
        )  # fmt: skip
        return finish is not None
