"""A vLLM worker extension: code that runs inside vLLM's worker process, via collective_rpc.

vLLM mixes this class into its worker class when started with
`worker_extension_cls="workers.engines.vllm.ext.DurableWorkerExtension"` (in-process engine)
or `--worker-extension-cls` (server), so `collective_rpc("durable_reload_weights", ...)`
reaches it. Method names carry a `durable_` prefix because vLLM refuses an extension whose
attribute names collide with the worker's own.

Why it exists: vLLM 0.32's in-place `reload_weights` is exact for dense models, but on CPU it
leaves MoE expert weights stale: the unquantized MoE method skips the CPU kernel's
`process_weights_after_loading` (its weight re-packing) when it sees a weight *update*
(measured: a reloaded tiny MoE generated other tokens than a fresh engine on the same
checkpoint). Re-running that step for every CPU MoE layer after the reload fixes it; on GPU
the unquantized method copies into the live storage itself and nothing is re-run here.
"""

from __future__ import annotations

from typing import Any

# What both vLLM engines give vLLM (`worker_extension_cls`, `--worker-extension-cls`), and the
# method they call through collective_rpc to reload weights.
EXTENSION = "workers.engines.vllm.ext.DurableWorkerExtension"
RELOAD_METHOD = "durable_reload_weights"


class DurableWorkerExtension:
    """Mixed into vLLM's Worker (so `self` is the worker: `model_runner`, `reload_weights`)."""

    def durable_reload_weights(self, path: str) -> str | None:
        """Reload weights in place from checkpoint directory `path`.

        Returns None, or an error message: an exception raised in a worker would reach the
        engine core as a failed step and can kill it, while a returned message lets the
        engine restore the previous checkpoint and keep serving.
        """
        worker: Any = self
        try:
            worker.reload_weights(weights_path=path, is_checkpoint_format=True)
            repack_cpu_moe(worker.model_runner.get_model())
        except Exception as exc:
            # Report, do not raise: see the docstring; the caller decides what to do.
            return f"{type(exc).__name__}: {exc}"
        return None

    def durable_weight_checksum(self) -> float:
        """Sum of every parameter (float64): lets tests see that a reload changed weights."""
        worker: Any = self
        return float(
            sum(p.double().sum().item() for p in worker.model_runner.get_model().parameters())
        )


def repack_cpu_moe(model: Any) -> int:
    """Re-run the CPU MoE kernel's weight preparation on every CPU MoE layer; return how many.

    0.32's layout: `layer.quant_method.moe_kernel.fused_experts` is the experts
    implementation; on CPU it is a `CPUUnquantizedExperts` whose
    `process_weights_after_loading` packs w13/w2 into the grouped-GEMM layout.
    """
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import (  # noqa: PLC0415
        CPUUnquantizedExperts,  # vLLM is only importable inside its worker process
    )

    count = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(module)
            count += 1
    return count
