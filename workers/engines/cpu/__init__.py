"""The CPU engine: a front end in the worker's process (`engine.CpuEngine`) and a core process
(`process`, running `core.EngineCore` on a transformers `model.CpuModel`), talking over the
framed pipes of `wire`; `sampling` and `stopping` decide each token as vLLM would."""
