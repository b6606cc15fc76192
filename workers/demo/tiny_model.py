"""Tiny random-weight models and a locally trained tokenizer, built without any download.

Tests and demos need a real Hugging Face model directory (config.json, generation_config.json,
model.safetensors, tokenizer.json, tokenizer_config.json) that transformers and vLLM load with
their ordinary code paths, but nothing may ever be fetched from a hub. So the tokenizer is a
byte-level BPE trained here on text generated in code, and the weights are drawn from a seeded
torch.Generator in sorted parameter-name order: the same seed gives byte-identical safetensors,
independent of transformers' own initialisation code (which changes between releases).

The architectures are the standard Qwen3 (dense) and Qwen3-MoE ones, which vLLM supports.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3MoeConfig,
)
from transformers.utils import logging as hf_logging

from workers.demo.tiny_tokenizer import (
    EOS_TOKEN,
    SPECIAL_TOKENS,
    VOCAB_SIZE,
    train_tokenizer,
    write_tokenizer_config,
)

__all__ = ["EOS_TOKEN", "SPECIAL_TOKENS", "VOCAB_SIZE", "make_tiny_checkpoint", "make_tiny_model"]

HIDDEN_SIZE = 64
# vLLM's CPU attention kernels support head sizes 32, 64, 80, ... only (16 fails at the first
# forward with "Unsupported CPU attention configuration"), and the same tiny model must run
# on every engine.
HEAD_DIM = 32
NUM_LAYERS = 2
NUM_EXPERTS = 8
TOP_K = 2
# Weights are N(0, INIT_GAIN**2 / fan_in). transformers' default (std 0.02) gives an almost
# flat next-token distribution, where greedy decoding hinges on near-ties; this gain makes the
# tiny model's preferences decisive (mean top-1 probability ~0.35) and its routing varied.
INIT_GAIN = 4.0


def build_tokenizer(seed: int = 0) -> PreTrainedTokenizerFast:
    """A byte-level BPE of about VOCAB_SIZE tokens, trained on generated text."""
    return PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(seed),
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=list(SPECIAL_TOKENS[1:]),
    )


def _config(*, moe: bool, vocab_size: int, eos_id: int) -> PretrainedConfig:
    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": HIDDEN_SIZE,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": HEAD_DIM,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "pad_token_id": eos_id,
        "torch_dtype": "float32",
    }
    if moe:
        return Qwen3MoeConfig(
            **common,
            intermediate_size=128,
            moe_intermediate_size=64,
            num_experts=NUM_EXPERTS,
            num_experts_per_tok=TOP_K,
            decoder_sparse_step=1,
            norm_topk_prob=True,
        )
    return Qwen3Config(**common, intermediate_size=128)


def _fill_weights(model: PreTrainedModel, seed: int) -> None:
    """Overwrite every tensor from one seeded generator, in sorted name order (determinism)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in sorted(model.state_dict().items()):
            if "norm" in name:
                # RMSNorm gains start at one, as in any freshly initialised transformer.
                tensor.fill_(1.0)
            else:
                fan_in = tensor.shape[-1] if tensor.dim() > 1 else 1
                std = INIT_GAIN / fan_in**0.5
                tensor.copy_(torch.randn(tensor.shape, generator=gen) * std)


# A model with a "tool turn" of K tokens (``make_tiny_model(tool_turn=K)``) says these K tokens
# in order after any other token; the last is its tool-call token (``tool_call_token``).
TOOL_TURN_FIRST_ID = 1000
# The turn's own dimensions of the residual stream outweigh everything the random layers add
# (their inputs are normalised, so what they add does not grow with it): the next token is
# decided by the last one. Measured on both architectures (greedy, 14 tokens): the turn's
# next token has probability > 0.9996 at every step at this scale (0.90 at 1e3, and 64 lost
# the turn altogether), so even sampling at temperature 1 almost always follows it.
_TURN_SCALE = 1e4
# The turn takes K + 1 of the HIDDEN_SIZE dimensions; the rest stay the random model's.
MAX_TOOL_TURN = 48
_TURN_GAIN = 2.0


def tool_call_token(tool_turn: int) -> int:
    """The tool-call token of a model made with ``tool_turn`` (the turn's last token)."""
    return TOOL_TURN_FIRST_ID + tool_turn - 1


def _tool_turn(model: PreTrainedModel, turn: int) -> None:
    """Make the random model say the turn's K tokens c_0 .. c_{K-1} after any other token,
    then c_0 again: dimensions 0..K of the embedding and the output head carry "the last
    token was c_k, or another one" and nothing else does. Everything else stays random (the
    logprobs, and with MoE the routes, are still those of a random model)."""
    with torch.no_grad():
        # By name (both architectures share them): typed as tensors, unlike the accessors.
        params = dict(model.named_parameters())
        embed, head = params["model.embed_tokens.weight"], params["lm_head.weight"]
        cycle = torch.arange(TOOL_TURN_FIRST_ID, TOOL_TURN_FIRST_ID + turn)
        embed[:, : turn + 1] = 0.0
        head[:, : turn + 1] = 0.0
        embed[:, turn] = _TURN_SCALE  # "another token": c_0 follows
        embed[cycle, turn] = 0.0
        embed[cycle, torch.arange(turn)] = _TURN_SCALE
        head[cycle[1:], torch.arange(turn - 1)] = _TURN_GAIN  # c_k -> c_{k+1}
        head[cycle[0], turn] = _TURN_GAIN  # another token -> c_0
        head[cycle[0], turn - 1] = _TURN_GAIN  # the tool-call token -> c_0 (a turn again)


def make_tiny_model(path: str | Path, *, moe: bool, seed: int = 0, tool_turn: int = 0) -> Path:
    """Write a tiny Qwen3 (dense) or Qwen3-MoE model directory at `path` and return it.

    The tokenizer depends only on a fixed seed (0), so every checkpoint of one architecture
    shares it; `seed` changes only the weights. ``tool_turn`` K > 0: the model says a fixed
    K-token turn after any other token, ending at its tool-call token (``tool_call_token``):
    episodes on it end every turn at a tool call after exactly K tokens (examples/).
    """
    if tool_turn < 0 or tool_turn > MAX_TOOL_TURN:
        raise ValueError(f"tool_turn must be 0..{MAX_TOOL_TURN}, got {tool_turn}")
    hf_logging.disable_progress_bar()  # "Writing model shards" bars are noise in tests and CLI
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(seed=0)
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    assert isinstance(eos_id, int)  # one token in, one id out
    config = _config(moe=moe, vocab_size=len(tokenizer), eos_id=eos_id)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _fill_weights(model, seed)
    if tool_turn:
        _tool_turn(model, tool_turn)
    model.eval()
    model.save_pretrained(out)
    GenerationConfig(bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id).save_pretrained(
        out
    )
    tokenizer.save_pretrained(out)
    write_tokenizer_config(out)
    _add_portable_config_keys(out, moe=moe)
    info = {"moe": moe, "seed": seed, **({"tool_turn": tool_turn} if tool_turn else {})}
    (out / "tiny_model.json").write_text(json.dumps(info) + "\n")
    return out


def _add_portable_config_keys(out: Path, *, moe: bool) -> None:
    """Also spell config.json the way transformers 4 (and vLLM built on it) reads it.

    transformers 5 writes `num_local_experts` and `rope_parameters`; transformers 4 reads
    `num_experts` (else it assumes 128 experts) and `rope_theta`. transformers 5 maps both
    old names back onto the new fields, so adding them changes nothing there.
    """
    path = out / "config.json"
    config = json.loads(path.read_text())
    if moe:
        config["num_experts"] = config.get("num_local_experts", NUM_EXPERTS)
    rope = config.get("rope_parameters") or {}
    config.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def make_tiny_checkpoint(path: str | Path, *, like: str | Path, seed: int) -> Path:
    """Another checkpoint with the architecture of the tiny model at `like`, for weight updates."""
    info = json.loads((Path(like) / "tiny_model.json").read_text())
    return make_tiny_model(
        path, moe=bool(info["moe"]), seed=seed, tool_turn=int(info.get("tool_turn", 0))
    )
