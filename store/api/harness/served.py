"""What this API says of the model it serves: the name harnesses send as ``model`` and the
context length they read from ``/v1/models`` (``rollouts api --served-model-name``,
``--max-model-len``; defaults from ``--tokenizer DIR``'s ``config.json``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

DEFAULT_NAME = "durable-rollouts"
# config.json fields that state the context length, in vLLM's order of preference.
_CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")


@dataclass(frozen=True, slots=True)
class ServedModel:
    name: str = DEFAULT_NAME
    max_model_len: int | None = None
    # A call naming another model is refused (404, as vLLM does) only when the name was
    # configured: by default a harness's own model name (SkyRL sends its path) is accepted.
    strict_name: bool = False

    def unknown(self, model: str | None) -> str | None:
        """Why a call naming ``model`` is refused (vLLM's 404 message), or None."""
        if model is not None and self.strict_name and model != self.name:
            return f"The model `{model}` does not exist."
        return None


def from_args(name: str | None, max_model_len: int | None, tokenizer: str | None) -> ServedModel:
    """``rollouts api``'s flags as a ``ServedModel``: an unset value comes from the tokenizer
    directory (its path names the model, as vLLM's served name defaults to the model path)."""
    if max_model_len is None and tokenizer:
        max_model_len = context_length(Path(tokenizer))
    return ServedModel(name=name or tokenizer or DEFAULT_NAME, max_model_len=max_model_len,
                       strict_name=name is not None)  # fmt: skip


def context_length(model_dir: Path) -> int | None:
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for key in _CONTEXT_FIELDS:
        value = config.get(key) if isinstance(config, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None
