"""A session's calls built into one trajectory (``store.trajectory.build``, pure): the added
prompt tokens of each call masked out, responses masked in with their logprobs and versions,
turns; a call that does not extend the context starts a segment, so does one after a gone
call; a call of n samples is followed through the sample the next call extends; an episode's
own mask is kept; the session's status from its rollouts' states."""

from __future__ import annotations

from typing import Any

import numpy as np

from statemachine import Status
from store.batches import BatchInfo
from store.results import RolloutResult
from store.trajectory import SegmentStart, SessionStatus, Trajectory, build

SYSTEM = (1, 2, 3, 4)


def result(rid: str, prompt: tuple[int, ...], response: list[int], *, version: int = 0,
           status: Status = Status.DONE, **more: Any) -> RolloutResult:  # fmt: skip
    n = len(response)
    return RolloutResult(
        rollout_id=rid, status=status, prompt_token_ids=prompt,
        response_token_ids=np.asarray(response, np.int32),
        logprobs=-np.arange(1, n + 1, dtype=np.float32) / 10,
        weight_versions=np.full(n, version, np.int64), routed_experts=None,
        finish_reason=None, stop_reason=None, text=None, error=None, attempts=1, aborts=0,
        nonfinite_logprobs=0, group_id=None, metadata={}, **more,
    )  # fmt: skip


def info(batch_id: str, n: int = 1) -> BatchInfo:
    return BatchInfo(batch_id=batch_id, groups=1, group_size=n, queue="q", submitted_at=0.0,
                     retention_s=60, named_ids=())  # fmt: skip


def session(*calls: list[RolloutResult], gone: tuple[int, ...] = ()) -> Trajectory:
    """Calls b0, b1, ... in order; those at ``gone`` listed without a record."""
    listed = [f"b{i}" for i in range(len(calls))]
    found = {b: (info(b, len(rs)), rs) for i, (b, rs) in enumerate(zip(listed, calls,
             strict=True)) if i not in gone}  # fmt: skip
    return build("s", listed, found)


def test_three_calls_that_extend_are_one_segment_with_the_loss_mask() -> None:
    p1 = SYSTEM
    p2 = (*p1, 10, 11, 50, 51, 52)  # the response, then the tool result the harness added
    p3 = (*p2, 12, 60)
    t = session([result("b0.0.0", p1, [10, 11])],
                [result("b1.0.0", p2, [12], version=1)],
                [result("b2.0.0", p3, [13, 14, 15], version=2)])  # fmt: skip
    assert t.status is SessionStatus.DONE and t.breaks == [] and t.gone == ()
    [seg] = t.segments
    assert seg.start is SegmentStart.FIRST and seg.prompt_token_ids == SYSTEM
    assert seg.token_ids.tolist() == [10, 11, 50, 51, 52, 12, 60, 13, 14, 15]
    assert seg.loss_mask.tolist() == [1, 1, 0, 0, 0, 1, 0, 1, 1, 1]
    assert seg.weight_versions.tolist() == [0, 0, -1, -1, -1, 1, -1, 2, 2, 2]
    np.testing.assert_allclose(seg.logprobs, [-0.1, -0.2, 0, 0, 0, -0.1, 0, -0.1, -0.2, -0.3])
    assert seg.turns == ((0, 2), (5, 6), (7, 10))
    assert [(c.batch_id, c.start, c.response_start, c.end) for c in seg.calls] == [
        ("b0", 0, 0, 2), ("b1", 2, 5, 6), ("b2", 6, 7, 10)]  # fmt: skip
    assert (seg.token_ids.dtype, seg.loss_mask.dtype, seg.logprobs.dtype,
            seg.weight_versions.dtype) == (np.int32, np.uint8, np.float32, np.int64)  # fmt: skip


def test_a_call_that_does_not_extend_starts_a_segment() -> None:
    p2 = (*SYSTEM, 10, 99, 50)  # the harness retokenized the response: 99, not 11
    t = session([result("b0.0.0", SYSTEM, [10, 11])], [result("b1.0.0", p2, [12])],
                [result("b2.0.0", (*p2, 12, 7), [13])])  # fmt: skip
    assert [s.start for s in t.segments] == [SegmentStart.FIRST, SegmentStart.NOT_EXTENDED]
    assert t.breaks == [1]
    second = t.segments[1]
    assert second.prompt_token_ids == p2  # whole: nothing spliced onto the first segment
    assert second.token_ids.tolist() == [12, 7, 13]
    assert second.loss_mask.tolist() == [1, 0, 1]
    assert t.segments[0].token_ids.tolist() == [10, 11]


def test_a_call_after_a_gone_one_starts_a_segment_saying_so() -> None:
    p2 = (*SYSTEM, 10, 50)
    t = session([result("b0.0.0", SYSTEM, [10])], [result("b1.0.0", p2, [11])],
                [result("b2.0.0", (*p2, 11, 51), [12])], gone=(1,))  # fmt: skip
    assert t.gone == ("b1",)
    assert [s.start for s in t.segments] == [SegmentStart.FIRST, SegmentStart.AFTER_GONE]
    # A call whose record is there but whose rollouts are all gone counts as gone too.
    t = session([result("b0.0.0", SYSTEM, [10])], [], [result("b2.0.0", (*p2, 11, 51), [12])])
    assert t.gone == ("b1",) and t.segments[1].start is SegmentStart.AFTER_GONE


def test_n_samples_follow_the_one_the_next_call_extends() -> None:
    samples = [result("b0.0.0", SYSTEM, [10]), result("b0.0.1", SYSTEM, [20]),
               result("b0.0.2", SYSTEM, [20, 21])]  # fmt: skip
    t = session(samples, [result("b1.0.0", (*SYSTEM, 20, 50), [30])])
    [seg] = t.segments
    assert [(c.rollout_id, c.sample) for c in seg.calls] == [("b0.0.1", 1), ("b1.0.0", 0)]
    assert seg.token_ids.tolist() == [20, 50, 30]
    # The last call (nothing extends it) is followed through its first sample.
    t = session(samples)
    assert t.segments[0].calls[0].sample == 0


def test_an_episode_call_keeps_its_own_mask_and_turns() -> None:
    episode = result("b0.0.0", SYSTEM, [10, 11, 70, 71, 12], loss_mask=np.array(
        [1, 1, 0, 0, 1], np.uint8), turns=((0, 2), (4, 5)))  # fmt: skip
    t = session([episode], [result("b1.0.0", (*SYSTEM, 10, 11, 70, 71, 12, 80), [13])])
    [seg] = t.segments
    assert seg.loss_mask.tolist() == [1, 1, 0, 0, 1, 0, 1]
    assert seg.turns == ((0, 2), (4, 5), (6, 7))


def test_status_running_failed_empty() -> None:
    done = result("b0.0.0", SYSTEM, [10])
    running = result("b1.0.0", (*SYSTEM, 10, 5), [11], status=Status.GENERATING)
    t = session([done], [running])
    assert t.status is SessionStatus.RUNNING
    assert t.segments[0].calls[1].status == "generating"  # its tokens so far are in
    assert t.segments[0].token_ids.tolist() == [10, 5, 11]
    failed = result("b1.0.0", (*SYSTEM, 10, 5), [], status=Status.FAILED)
    assert session([done], [failed]).status is SessionStatus.FAILED
    assert build("s", [], {}).status is SessionStatus.EMPTY
    assert session([], gone=(0,)).segments == ()
