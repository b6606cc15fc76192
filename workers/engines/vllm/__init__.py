"""The vLLM engines: AsyncLLM in this process (`local`) and vLLM servers over HTTP (`http`,
on `http_pool` and the wire format of `wire`). Both translate requests and outputs the same
way (`translate`) and swap weights under in-flight requests the same way (`swap`); `ext` runs
inside vLLM's worker processes.

Every import in this package is absolute, so `vllm` here always means the real vLLM package.
"""
