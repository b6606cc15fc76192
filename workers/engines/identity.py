"""Which model an engine runs, as a short string that two workers agree on; and the eos ids
its directory declares, which every engine reads the same way.

Every attempt of a rollout records it (``Started.model``/``Resumed.model``) and the domain
refuses an attempt on another model, so a trajectory never mixes two models' tokens, e.g.
when a rollout submitted for a dense model is resumed by a worker serving a MoE one.

The identity is ``model_type:fingerprint``, the fingerprint a hash of ``config.json`` without
the keys that say where or how a copy was saved rather than what the model is. Two directories
holding the same architecture therefore agree wherever they are mounted; weight updates do not
change it (a checkpoint of another architecture is refused at load).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

# Where or how a copy was saved, not what the model is: a checkpoint the trainer writes in
# another dtype, with another transformers version, from another path is the same model.
_NOT_IDENTITY = frozenset({"_name_or_path", "transformers_version", "torch_dtype", "dtype"})


def config_identity(config: dict[str, Any]) -> str:
    kept = {k: v for k, v in config.items() if k not in _NOT_IDENTITY}
    canonical = json.dumps(kept, sort_keys=True, separators=(",", ":"), default=str)
    digest = hashlib.sha256(canonical.encode()).hexdigest()[:16]
    return f"{config.get('model_type') or 'model'}:{digest}"


def model_identity(model_dir: str | Path) -> str:
    """The identity of a Hugging Face model directory, from its ``config.json``."""
    path = Path(model_dir) / "config.json"
    config = json.loads(path.read_text())
    if not isinstance(config, dict):
        raise ValueError(f"{path} is not a JSON object")
    return config_identity(config)


def eos_token_ids(model_dir: str | Path) -> frozenset[int]:
    """Every eos id of a model directory (config.json and generation_config.json): each one
    ends generation with stop reason None, whichever file named it."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = Path(model_dir) / name
        if not path.exists():
            continue
        value = json.loads(path.read_text()).get("eos_token_id")
        ids.update(value if isinstance(value, list) else [] if value is None else [value])
    return frozenset(int(i) for i in ids)
