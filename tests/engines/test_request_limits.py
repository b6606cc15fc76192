"""The checks every engine holds a request to (``inflight.check_request``), the cap a request
may ask for (``fit_to_context``), and how vLLM's refusals become ``RequestRejected``."""

from __future__ import annotations

import pytest

from statemachine import SamplingParams
from workers.engines.base import EngineLimits, EngineRequest
from workers.engines.errors import EngineDead, EngineError, RequestRejected
from workers.engines.inflight import check_request, fit_to_context

LIMITS = EngineLimits(context_length=16, vocab_size=100)


def req(prompt: tuple[int, ...], max_tokens: int, resumed: int = 0, **kw: object) -> EngineRequest:
    sampling = SamplingParams(max_tokens=max_tokens, **kw)  # type: ignore[arg-type]
    return EngineRequest(
        request_id="r", prompt_token_ids=prompt, sampling=sampling, resumed_tokens=resumed
    )


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (req((1,) * 16, 1), "prompt of 16 tokens leaves no room within ctx=16"),
        (req((1,) * 17, 1), "prompt of 17 tokens leaves no room"),
        (req((1,) * 16, 1, resumed=4), "prompt + tokens so far of 16 tokens leaves no room"),
        (req((1, 100), 1), "prompt token ids outside the vocabulary (size 100): [100]"),
        (req((1, 2), 1, stop_token_ids=(7, 250)), "stop_token_ids token ids outside"),
        (req((1,) * 8, 9), "prompt of 8 tokens + max_tokens 9 exceeds ctx=16"),
        (req((), 1), "must not be empty"),
    ],
)
def test_requests_no_engine_of_this_model_can_serve(request_: EngineRequest, message: str) -> None:
    with pytest.raises(RequestRejected) as info:
        check_request(request_, LIMITS, context_name="ctx")
    assert message in str(info.value)


def test_what_fits_passes_and_unknown_limits_check_nothing() -> None:
    check_request(req((1,) * 8, 8), LIMITS, context_name="ctx")  # exactly the context
    check_request(req((1,) * 15, 1), LIMITS, context_name="ctx")
    check_request(req((10**6,) * 40, 10**6), EngineLimits(None, None), context_name="ctx")


def test_a_capped_request_gets_what_the_context_leaves() -> None:
    capped = req((1,) * 10, 50, min_tokens=20, cap_to_context=True)
    check_request(capped, LIMITS, context_name="ctx")  # asked to be capped: not refused
    fitted = fit_to_context(capped, LIMITS)
    assert (fitted.sampling.max_tokens, fitted.sampling.min_tokens) == (6, 6)
    assert fit_to_context(req((1,) * 10, 50), LIMITS).sampling.max_tokens == 50  # not asked
    small = req((1,), 3, cap_to_context=True)
    assert fit_to_context(small, LIMITS) is small
    # Still refused when the prompt alone fills the context: nothing could be generated.
    with pytest.raises(RequestRejected):
        check_request(req((1,) * 16, 50, cap_to_context=True), LIMITS, context_name="ctx")


def test_cap_to_context_is_recorded_only_when_set() -> None:
    # Records of requests without it stay byte for byte what they were.
    assert "cap_to_context" not in SamplingParams(max_tokens=4).to_dict()
    on = SamplingParams(max_tokens=4, cap_to_context=True)
    assert SamplingParams.from_dict(on.to_dict()) == on


@pytest.mark.vllm  # skipped without vLLM, failed instead where CI requires it
def test_vllms_validation_errors_are_request_errors() -> None:
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.engine.exceptions import EngineDeadError

    from workers.engines.vllm.local import _submit_error

    # A real refusal by vLLM 0.32's own checks of sampling values.
    with pytest.raises(VLLMValidationError) as refused:
        VllmSamplingParams(max_tokens=4, top_p=0.0)
    assert isinstance(_submit_error(refused.value), RequestRejected)
    assert isinstance(_submit_error(ValueError("prompt too long")), RequestRejected)
    dead = _submit_error(EngineDeadError())
    assert isinstance(dead, EngineDead) and not isinstance(dead, RequestRejected)
    other = _submit_error(RuntimeError("boom"))
    assert type(other) is EngineError
