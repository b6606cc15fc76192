"""Deciding, after each sampled token, whether a request is finished and why (as vLLM does)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from statemachine.request import SamplingParams
from statemachine.states import FinishReason

Decode = Callable[[Sequence[int]], str]


class StopChecker:
    """Per-request stop logic, in vLLM's order: eos, stop token ids, stop strings, length.

    - Nothing stops a request before min_tokens tokens exist (vLLM's `check_stop`), and stop
      strings are only looked for once more than min_tokens tokens exist (vLLM's detokenizer).
    - Every eos id (from config.json and generation_config.json) stops with stop_reason None
      unless ignore_eos; a stop token id stops with that id as stop_reason.
    - Stop strings are matched on the text decoded (special tokens skipped, as vLLM's
      default) from the tokens generated *by this request*; the token that completes a stop
      string is kept in the output and stop_reason is the string. On a resume the partial
      tokens are part of the prompt, so a stop string spanning the resume boundary is not
      seen (vLLM has the same blind spot).
    """

    def __init__(
        self,
        params: SamplingParams,
        *,
        eos_token_ids: frozenset[int],
        decode: Decode | None,
        max_total_tokens: int,
    ) -> None:
        self._params = params
        self._eos = frozenset() if params.ignore_eos else eos_token_ids
        self._stop_ids = frozenset(params.stop_token_ids)
        self._decode = decode
        self._max_total = max_total_tokens
        self._checked_chars = 0  # text before this offset has been searched for stop strings
        self._longest_stop = max((len(s) for s in params.stop), default=0)

    def check(
        self, generated: Sequence[int], total_tokens: int
    ) -> tuple[FinishReason | None, int | str | None]:
        """Finish reason and stop reason after `generated[-1]` was appended (or Nones)."""
        n = len(generated)
        if n < self._params.min_tokens:
            return None, None
        token = generated[-1]
        if token in self._eos:
            return FinishReason.STOP, None
        if token in self._stop_ids:
            return FinishReason.STOP, token
        if self._params.stop and n > self._params.min_tokens:
            hit = self._stop_string(generated)
            if hit is not None:
                return FinishReason.STOP, hit
        if n >= self._params.max_tokens or total_tokens >= self._max_total:
            return FinishReason.LENGTH, None
        return None, None

    def _stop_string(self, generated: Sequence[int]) -> str | None:
        if self._decode is None:
            # Constructed without a tokenizer: the engine refuses stop strings up front.
            return None
        text = self._decode(generated)
        # A stop string that ends in the new text may begin up to len(stop)-1 chars earlier.
        start = max(0, self._checked_chars - self._longest_stop + 1)
        best: tuple[int, str] | None = None
        for stop in self._params.stop:
            at = text.find(stop, start)
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        # A trailing U+FFFD is an incomplete UTF-8 sequence that the next token may complete;
        # search it again next time.
        self._checked_chars = len(text.rstrip("\ufffd"))
        return None if best is None else best[1]
