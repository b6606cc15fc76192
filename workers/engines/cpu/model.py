"""The transformers model behind the CPU engine: loading, one-token forwards, routing, swaps.

Only the CPU engine's core (`cpu.core.EngineCore`, in a process of its own) calls into a
`CpuModel` (torch modules are not safe to drive from two threads at once).

Why every forward feeds exactly one token, prompt included: on CPU, a 20-token prefill and
20 one-token decode steps give logits that differ by ~1e-5 (different matmul and attention
kernels for different shapes). Feeding one token at a time makes the computation for a
position identical however the sequence was split (prefill vs decode, abort and resume,
re-prefill after a weight update, alone or with other requests in flight), so greedy results
and logprobs are bit-for-bit reproducible. The price is prefill speed, which does not matter
for the tiny test models this engine serves.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from workers.engines.base import config_expert_dtype
from workers.engines.errors import WeightLoadError
from workers.engines.identity import eos_token_ids


def _load(source: str | Path) -> Any:
    # A path that is not a directory would be taken for a hub repo id: refuse it instead, and
    # never let transformers fetch anything (local_files_only).
    if not Path(source).is_dir():
        raise OSError(f"{source!s} is not a model directory")
    model = AutoModelForCausalLM.from_pretrained(
        str(source), dtype=torch.float32, local_files_only=True
    )
    return model.eval()


class RouterCapture:
    """Records each MoE layer's top-k expert indices from the model's own router modules.

    transformers 5 routers (Qwen3-MoE, Qwen2-MoE, Mixtral `*TopKRouter`) return
    (logits, scores, indices): we keep `indices`, the very tensor the experts are dispatched
    with, so order and tie-breaking are the model's. transformers 4 gates are a plain Linear
    returning logits, and the MoE block then takes topk(softmax(logits, float32)): we repeat
    exactly that.
    """

    def __init__(self, model: Any) -> None:
        self.top_k = int(model.config.num_experts_per_tok)
        dtype = config_expert_dtype(model.config.to_dict())
        if dtype is None:
            raise ValueError(f"{type(model).__name__} has MoE gates but no expert count")
        self.dtype = dtype
        gates = [
            layer.mlp.gate
            for layer in model.model.layers
            if hasattr(layer, "mlp") and hasattr(layer.mlp, "gate")
        ]
        self.num_layers = len(gates)
        self._rows: list[torch.Tensor] = []
        for gate in gates:
            gate.register_forward_hook(self._hook)

    def _hook(self, _module: Any, _args: Any, output: Any) -> None:
        if isinstance(output, tuple):
            indices = output[2]
        else:
            probs = torch.softmax(output, dim=-1, dtype=torch.float)
            indices = torch.topk(probs, self.top_k, dim=-1).indices
        self._rows.append(indices.reshape(-1, self.top_k)[-1])

    def start(self) -> None:
        self._rows.clear()

    def take(self) -> np.ndarray:
        """[n_moe_layers, top_k] of the last forward's last position."""
        rows = torch.stack(self._rows).numpy().astype(self.dtype)
        self._rows.clear()
        return rows


class CpuModel:
    """A float32 causal LM in eval mode with a per-request KV cache API."""

    def __init__(self, source: str | Path) -> None:
        self.model = _load(source)
        self.tokenizer = AutoTokenizer.from_pretrained(str(source), local_files_only=True)
        self.eos_token_ids = eos_token_ids(source)
        self.vocab_size = int(self.model.get_input_embeddings().num_embeddings)
        self.max_positions = int(getattr(self.model.config, "max_position_embeddings", 1 << 30))
        is_moe = any(
            hasattr(layer, "mlp") and hasattr(layer.mlp, "gate")
            for layer in self.model.model.layers
        )
        self.router = RouterCapture(self.model) if is_moe else None
        # transformers 5.2x renamed `past_key_values` to `cache` (the old name warns until
        # 5.40); pass whichever this release's forward takes.
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    def new_cache(self) -> Any:
        return DynamicCache(config=self.model.config)

    def forward(self, token: int, cache: Any) -> tuple[torch.Tensor, np.ndarray | None]:
        """Feed one token; return its position's float32 logits [vocab] and routing rows."""
        if self.router is not None:
            self.router.start()
        ids = torch.tensor([[token]], dtype=torch.long)
        out = self.model(input_ids=ids, use_cache=True, **{self._cache_kw: cache})
        routing = self.router.take() if self.router is not None else None
        return out.logits[0, -1].float(), routing

    def decode(self, token_ids: Any) -> str:
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))

    def swap_weights(self, source: str | Path) -> None:
        """Copy a same-architecture checkpoint's tensors into the live parameters, in place.

        The checkpoint is loaded through from_pretrained (which knows each architecture's
        on-disk layout, e.g. per-expert tensors vs transformers 5's fused experts) and then
        copied with load_state_dict, so module objects, and the router hooks on them, stay.
        Checked before any copy: on a mismatch the live weights are untouched.
        """
        try:
            new = _load(source)
        except (OSError, ValueError) as exc:
            # A missing directory, missing files or an unreadable config.
            raise WeightLoadError(f"cannot load checkpoint {source!s}: {exc}") from exc
        live = self.model.state_dict()
        incoming = new.state_dict()
        if type(new) is not type(self.model) or {k: v.shape for k, v in live.items()} != {
            k: v.shape for k, v in incoming.items()
        }:
            raise WeightLoadError(
                f"checkpoint {source!s} ({type(new).__name__}) does not match the loaded "
                f"architecture ({type(self.model).__name__})"
            )
        with torch.no_grad():
            self.model.load_state_dict(incoming, strict=True)
