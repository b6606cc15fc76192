"""An episode's turns on the worker: what the engine is asked to stop at, and how a turn that
stopped at a tool call becomes the call's request.

A turn is one attempt's generation: the engine gets the whole context so far (prompt, sampled
and observation tokens, as fed before) and the episode's tool-call stops besides the request's
own. A stop of the episode's ends the turn at a call: its last tokens and ``ToolCallRequested``
go in one chain (``episode_commands.request_call``), recorded before any tool runs. Any other
end (eos, a plain stop, length) ends the episode as it ends a plain rollout.

Without a parser, the worker does not read the model's tool-call syntax: the call is named by
the episode's one declared tool (or, with several, by the stop that ended the turn), and its
arguments are the turn's sampled token ids. The environment holds the tokenizer anyway (it
produces the observation's token ids), so it decodes and parses them there.

With ``parser="hermes"`` (Qwen's and Hermes's ``<tool_call>{"name": .., "arguments": {..}}
</tool_call>``, read as vLLM's ``hermes`` parser reads it: ``store.tool_parser``) the turn ends
at ``</tool_call>`` (its token id where the tokenizer has it as one token, as Qwen's does; else
the string), and the worker decodes the turn with its model's tokenizer and records the first
call's name and arguments. A turn whose call does not parse ends the episode as the model's
stop, with its text kept: what vLLM would answer (content, no tool call).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from statemachine import FinishReason, RolloutState
from statemachine.episode import EpisodeSpec
from statemachine.request import SamplingParams
from store import tool_parser

HERMES = "hermes"
PARSERS = (HERMES,)  # the tool-call parsers workers serve


def parser_stops(tokenizer: Any) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Where a ``hermes`` turn ends: the id of ``</tool_call>`` when the tokenizer has it as
    one token (an engine stops on an id exactly, whatever it detokenizes), else the string."""
    ids = tokenizer.encode(tool_parser.END, add_special_tokens=False)
    if len(ids) == 1 and tokenizer.convert_ids_to_tokens(ids[0]) == tool_parser.END:
        return (int(ids[0]),), ()
    return (), (tool_parser.END,)


def turn_sampling(state: RolloutState, tokenizer: Any = None) -> SamplingParams:
    """The sampling of the rollout's next attempt: for an episode, with its tool-call stops
    (and its parser's, with ``tokenizer``) added to the request's own (a plain rollout's is
    ``resume_sampling`` as it was)."""
    sampling = state.resume_sampling()
    episode = state.request.episode
    if episode is None:
        return sampling
    ids, strings = call_stops(episode, tokenizer)
    ids = sampling.stop_token_ids + tuple(t for t in ids if t not in sampling.stop_token_ids)
    strings = sampling.stop + tuple(s for s in strings if s not in sampling.stop)
    return replace(sampling, stop_token_ids=ids, stop=strings)


def call_stops(episode: EpisodeSpec, tokenizer: Any) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Every stop that ends a turn at a tool call: the episode's own and its parser's."""
    ids, strings = episode.tool_call_stop_token_ids, episode.tool_call_stop_strings
    if episode.parser == HERMES and tokenizer is not None:
        more_ids, more_strings = parser_stops(tokenizer)
        ids, strings = ids + more_ids, strings + more_strings
    return ids, strings


def turn_tokens(state: RolloutState) -> int:
    """Sampled tokens of the turn under way: the trailing ids of ``resume_prompt`` that are the
    rollout's own output since the last observation (all of them for a plain rollout). An
    engine needs them to see a stop string that straddles a resume point, and not one that
    would straddle an observation."""
    last = state.calls[-1].offset if state.calls else 0
    return state.num_tokens - last


def observation_routes_from(state: RolloutState) -> int | None:
    """Where the routes of the observation before the turn begin in ``resume_prompt`` (the
    engine request's ``prompt_routes_from``), when the turn is to record them: on the turn's
    first chunk, so only while it has no token saved (an attempt that ended before its first
    checkpoint asks again; once one is saved, they are recorded or the engine had none).

    Under the row convention of ``Chunk.routed_experts`` an observation of ``m`` tokens ending
    the prompt has its rows at prompt tokens ``len - m .. len - 1``: the forwards at positions
    ``len - m - 1`` (the previous turn's last sampled token, the call's stop) to ``len - 2``.
    The forward at ``len - 1`` produces the turn's first token, whose row it is. A replay of
    the whole context thus finds one route for every position from the first sampled token on.
    None for a plain rollout, a first turn, or an empty observation."""
    last = state.calls[-1] if state.calls else None
    if last is None or last.result is None or state.num_tokens != last.offset:
        return None
    m = last.observation_tokens
    if m == 0:
        return None
    return len(state.request.prompt_token_ids) + state.context_tokens - m


def unserved_parser(state: RolloutState, tokenizer: Any) -> str | None:
    """Why this worker cannot run the episode's turns, if it cannot: it names a tool-call
    parser that is not served, or that needs the model's tokenizer and there is none here."""
    episode = state.request.episode
    if episode is None or episode.parser is None:
        return None
    if episode.parser not in PARSERS:
        return (
            f"tool-call parser {episode.parser!r} is not served (served: {', '.join(PARSERS)}); "
            "or end turns with tool_call_stop_token_ids or tool_call_stop_strings"
        )
    if tokenizer is None:
        return (
            f"tool-call parser {episode.parser!r} reads the turn's text, and this worker's "
            "engine has no tokenizer to decode it with"
        )
    return None


def stopped_at_call(
    episode: EpisodeSpec | None,
    reason: FinishReason,
    stop_reason: int | str | None,
    tokenizer: Any = None,
) -> bool:
    """Whether a turn that ended with ``reason``/``stop_reason`` ended at a tool call."""
    if episode is None or reason is not FinishReason.STOP or stop_reason is None:
        return False
    ids, strings = call_stops(episode, tokenizer)
    return stop_reason in (strings if isinstance(stop_reason, str) else ids)


def call_of(
    episode: EpisodeSpec, stop_reason: int | str, turn_token_ids: list[int], tokenizer: Any = None
) -> tuple[str, str] | None:
    """The call's name and arguments (JSON text) for a turn that stopped at a call; None when
    its parser finds no call in the turn's text (the episode then ends as the model's stop)."""
    if episode.parser == HERMES:
        text = tokenizer.decode(turn_token_ids, skip_special_tokens=False)
        calls = tool_parser.parse(text).calls
        return (calls[0].name, calls[0].arguments) if calls else None
    if len(episode.tools) == 1:
        name = episode.tools[0].name
    else:
        name = stop_reason if isinstance(stop_reason, str) else str(stop_reason)
    return name, json.dumps({"token_ids": turn_token_ids}, separators=(",", ":"))


def length_reason(state: RolloutState, produced: int) -> FinishReason:
    """Why a stream that ran out of tokens ended, ``produced`` tokens after ``state``: an
    episode whose context (sampled and observation tokens) then fills ``max_total_tokens``
    ended on that budget, which is what capped its request; anything else by ``length``."""
    episode = state.request.episode
    cap = None if episode is None else episode.max_total_tokens
    if cap is not None and state.context_tokens + produced >= cap:
        return FinishReason.MAX_TOTAL_TOKENS
    return FinishReason.LENGTH


def wall_time_left(state: RolloutState, now: float) -> float | None:
    """Seconds until the episode's ``max_wall_seconds`` since submission run out (<= 0: they
    have), by ``now`` (this host's clock, as the submitter's stamped ``submitted_at``: the
    budget is a wall-clock one, and hosts are expected to keep time within the budget's
    precision); None for a plain rollout or an episode without that budget."""
    episode = state.request.episode
    if episode is None or episode.max_wall_seconds is None:
        return None
    return state.submitted_at + episode.max_wall_seconds - now


def engine_tokenizer(engine: Any) -> Any:
    """The engine's tokenizer (``tokenizer``), else its model directory's (``source``, when it
    holds a tokenizer), else None."""
    tokenizer = getattr(engine, "tokenizer", None)
    if tokenizer is not None:
        return tokenizer
    source = getattr(engine, "source", None)
    if not isinstance(source, str) or not (Path(source) / "tokenizer_config.json").is_file():
        return None
    from transformers import AutoTokenizer  # noqa: PLC0415  (seconds to import; rarely needed)

    return AutoTokenizer.from_pretrained(source, local_files_only=True)
