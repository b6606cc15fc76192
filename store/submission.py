"""A trainer's submission, checked and turned into the events that record it, before any I/O.

Everything that can be checked without the model is checked here, so a refused submit writes
nothing: each prompt and its sampling (``statemachine.request`` checks types and ranges), the
group size, metadata size, a ``max_tokens`` cap, the ids (the rules of ``store.keys``), and
duplicates within the call. The rollout ids of a batch are ``<batch>.<group>.<sample>`` unless
the caller names them; the batch id is the idempotency key: a retried submit under it builds
the same ids and the same records (``at`` excepted, which is why the store compares requests,
not record bytes), and so enqueues nothing new.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import msgpack

from statemachine import (
    EpisodeSpec,
    GroupPolicy,
    InvalidRequest,
    Membership,
    RolloutRequest,
    SamplingParams,
    Submitted,
    commands,
)
from store import defaults
from store.keys import check_batch_id, check_rollout_id


class ChatTemplater(Protocol):
    """What a submit with chat messages needs of a tokenizer (a transformers tokenizer is one)."""

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class ChatRequest:
    """A prompt given as chat messages; the client applies its tokenizer's chat template at
    submit and records the resulting token ids (the record never depends on a tokenizer)."""

    messages: Sequence[Mapping[str, Any]]
    sampling: SamplingParams | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    max_staleness: int | None = None
    # A multi-turn episode from these messages: they are templated once, here; what each tool
    # call's observation adds (template tokens included) is its environment's to tokenize.
    episode: EpisodeSpec | None = None


Prompt = RolloutRequest | ChatRequest


@dataclass(frozen=True, slots=True)
class Submission:
    """A checked submission: its batch, the rollout ids (group-major), and what their
    ``Submitted`` events are made of. The events are made when asked for (``events_between``:
    the submit makes them chunk by chunk, while Redis records the previous chunk); all of
    them differ only in their id and indexes, which ``build`` checked, and ``build`` makes
    the first and the last, so that making any of them cannot fail once writing started."""

    batch_id: str
    group_size: int
    ids: list[str]
    requests: list[RolloutRequest]  # one per group, in its group
    group_policy: GroupPolicy
    queue: str
    admitted_version: int
    at: float
    fingerprint: str

    def __len__(self) -> int:
        return len(self.ids)

    def event(self, k: int) -> Submitted:
        g, sample = divmod(k, self.group_size)
        member = Membership(
            batch_id=self.batch_id,
            group_index=g,
            sample_index=sample,
            group_size=self.group_size,
            group_policy=self.group_policy,
        )
        return commands.submit(
            self.ids[k],
            self.requests[g],
            admitted_version=self.admitted_version,
            queue=self.queue,
            membership=member,
            at=self.at,
        )

    def events_between(self, start: int, stop: int) -> list[Submitted]:
        return [self.event(k) for k in range(start, min(stop, len(self.ids)))]

    @property
    def events(self) -> list[Submitted]:
        return self.events_between(0, len(self.ids))

    def groups(self) -> list[list[str]]:
        ids = self.ids
        return [ids[i : i + self.group_size] for i in range(0, len(ids), self.group_size)]


def build(
    prompts: Sequence[Prompt],
    *,
    n: int = 1,
    sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    batch_id: str | None = None,
    ids: Sequence[str] | None = None,
    group_policy: GroupPolicy | str = GroupPolicy.SAMPLE,
    queue: str,
    admitted_version: int,
    at: float,
    tokenizer: ChatTemplater | None = None,
    max_tokens_cap: int | None = defaults.MAX_TOKENS_CAP,
) -> Submission:
    """Check a submission and build its events; raises ``InvalidRequest`` (or
    ``InvalidRolloutId``) naming the field, having done nothing else."""
    if isinstance(prompts, RolloutRequest | ChatRequest) or not isinstance(prompts, Sequence):
        raise InvalidRequest("prompts must be a list of RolloutRequest or ChatRequest")
    if not prompts:
        raise InvalidRequest("prompts must not be empty")
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= defaults.MAX_GROUP_SIZE:
        raise InvalidRequest(f"n must be an int in [1, {defaults.MAX_GROUP_SIZE}], got {n!r}")
    try:
        policy = GroupPolicy(group_policy)
    except ValueError:
        choices = [p.value for p in GroupPolicy]
        raise InvalidRequest(
            f"group_policy must be one of {choices}, got {group_policy!r}"
        ) from None
    per_prompt = _sampling_per_prompt(sampling, len(prompts))
    requests = [
        _request(i, p, per_prompt[i], tokenizer, max_tokens_cap) for i, p in enumerate(prompts)
    ]
    total = len(requests) * n
    if total > defaults.MAX_SUBMIT_ROLLOUTS:
        raise InvalidRequest(
            f"{total} rollouts in one submit; at most {defaults.MAX_SUBMIT_ROLLOUTS}"
        )
    fingerprint = _fingerprint(requests, n, policy, queue, ids)
    if batch_id is None:
        # Named ids make a retry recognisable even without a batch id: derive it from what
        # was asked, so the retry lands on the same batch (and so the same records).
        batch_id = f"ids-{fingerprint[:24]}" if ids is not None else uuid.uuid4().hex
    check_batch_id(batch_id)
    if ids is None:
        rollout_ids = [f"{batch_id}.{g}.{s}" for g in range(len(requests)) for s in range(n)]
    else:
        if isinstance(ids, str) or len(ids) != total:
            raise InvalidRequest(f"ids must name {total} rollouts ({len(requests)} x n={n})")
        rollout_ids = [check_rollout_id(r) for r in ids]
        seen: set[str] = set()
        dups = [r for r in rollout_ids if r in seen or seen.add(r)]  # type: ignore[func-returns-value]
        if dups:
            raise InvalidRequest(f"ids: {sorted(set(dups))[:5]} appear more than once")
    # Once per prompt, not per sample: replace() checks the whole request again.
    requests = [
        r if r.group_id is not None else r.in_group(f"{batch_id}.{g}")
        for g, r in enumerate(requests)
    ]
    made = Submission(
        batch_id=batch_id,
        group_size=n,
        ids=rollout_ids,
        requests=requests,
        group_policy=policy,
        queue=queue,
        admitted_version=admitted_version,
        at=at,
        fingerprint=fingerprint,
    )
    made.event(0), made.event(total - 1)  # the others differ only in what was checked above
    return made


def same_submission(a: Submitted, b: Submitted) -> bool:
    """Whether two records submit the same rollout: all but the time and the admitted weight
    version, which a retry legitimately sees anew."""
    return (a.request.to_dict(), a.queue, a.membership) == (
        b.request.to_dict(),
        b.queue,
        b.membership,
    )


def _sampling_per_prompt(
    sampling: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams | None]:
    if sampling is None or isinstance(sampling, SamplingParams):
        return [sampling] * count
    if isinstance(sampling, str) or not isinstance(sampling, Sequence):
        raise InvalidRequest("sampling must be SamplingParams or one per prompt")
    if len(sampling) != count or not all(isinstance(s, SamplingParams) for s in sampling):
        raise InvalidRequest(f"sampling: {len(sampling)} SamplingParams for {count} prompts")
    return list(sampling)


def _request(
    index: int,
    prompt: Prompt,
    sampling: SamplingParams | None,
    tokenizer: ChatTemplater | None,
    max_tokens_cap: int | None,
) -> RolloutRequest:
    where = f"prompts[{index}]"
    try:
        if isinstance(prompt, ChatRequest):
            request = _from_chat(prompt, sampling, tokenizer)
        elif isinstance(prompt, RolloutRequest):
            request = prompt if sampling is None else replace(prompt, sampling=sampling)
        else:
            raise InvalidRequest(
                f"must be a RolloutRequest or a ChatRequest, got {type(prompt).__name__}"
            )
        _check_submittable(request, max_tokens_cap)
    except InvalidRequest as exc:
        raise InvalidRequest(f"{where}: {exc}") from None
    return request


def _from_chat(
    prompt: ChatRequest, sampling: SamplingParams | None, tokenizer: ChatTemplater | None
) -> RolloutRequest:
    if tokenizer is None:
        raise InvalidRequest("messages need a client with a tokenizer (its chat template)")
    sampling = sampling or prompt.sampling
    if sampling is None:
        raise InvalidRequest("sampling: a chat request needs SamplingParams")
    messages = list(prompt.messages)
    if not messages or not all(
        isinstance(m, Mapping) and isinstance(m.get("role"), str) and "content" in m
        for m in messages
    ):
        raise InvalidRequest("messages must be a non-empty list of {role, content} mappings")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, Mapping):  # some tokenizers answer a BatchEncoding
        ids = ids["input_ids"]
    return RolloutRequest(
        prompt_token_ids=tuple(int(t) for t in ids),
        sampling=sampling,
        metadata=dict(prompt.metadata),
        max_staleness=prompt.max_staleness,
        episode=prompt.episode,
    )


def _check_submittable(request: RolloutRequest, max_tokens_cap: int | None) -> None:
    """What the domain's request type allows but this deployment does not take."""
    s = request.sampling
    if max_tokens_cap is not None and s.max_tokens > max_tokens_cap:
        raise InvalidRequest(f"sampling.max_tokens must be <= {max_tokens_cap}, got {s.max_tokens}")
    size = len(msgpack.packb(request.metadata, use_bin_type=True))
    if size > defaults.MAX_METADATA_BYTES:
        raise InvalidRequest(
            f"metadata is {size} bytes packed; at most {defaults.MAX_METADATA_BYTES}"
        )


def _fingerprint(
    requests: list[RolloutRequest],
    n: int,
    policy: GroupPolicy,
    queue: str,
    ids: Sequence[str] | None,
) -> str:
    body = msgpack.packb(
        [[r.to_dict() for r in requests], n, policy.value, queue, list(ids or [])],
        use_bin_type=True,
    )
    return hashlib.sha256(body).hexdigest()


class Batch(list[str]):
    """The rollout ids of one submit (group-major: the samples of prompt 0, then of prompt
    1, ...), with the batch they belong to."""

    def __init__(self, s: Submission, *, fresh: bool = False) -> None:
        super().__init__(s.ids)
        self.batch_id = s.batch_id
        self.group_size = s.group_size
        # Created by the submit that returned it (not a retry's): ``RolloutClient.wait``
        # follows its completions from the start, its rollouts' heads unread.
        self.fresh = fresh

    def groups(self) -> list[list[str]]:
        n = self.group_size
        return [self[i : i + n] for i in range(0, len(self), n)]
