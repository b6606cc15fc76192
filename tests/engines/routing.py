"""The routing a plain forward pass gives: what the engines' routed experts are checked against."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from workers.demo.tiny_model import TOP_K


def hf_routing(model_dir: Path, ids: list[int]) -> np.ndarray:
    """[len(ids), layers, top_k]: the router's top-k per input position, from one full forward
    of HF's model over ``ids`` (not the engines' one-token forwards)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_router_logits=True)
    per_layer = [
        # What Qwen3MoeTopKRouter does: softmax in float32, then topk of the probabilities.
        torch.topk(torch.softmax(logits.float(), dim=-1), TOP_K, dim=-1).indices
        for logits in out.router_logits
    ]
    return torch.stack(per_layer, dim=1).numpy()
