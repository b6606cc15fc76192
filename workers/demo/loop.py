"""The demo's trainer loop: what an RL trainer does with the trainer API, and the faults.

Each step submits ``prompts x samples`` rollouts (one batch, the default group policy),
consumes its groups in completion order, acknowledges them, and publishes new weights (a small
perturbation of the current ones, written as a checkpoint the CPU engine loads) while the next
step's rollouts, already submitted, generate: the workers abort those at once, keep their
tokens, and resume them on the new weights. During one step a worker is SIGKILLed while it has
rollouts generating, and a replacement is started.
"""

from __future__ import annotations

import asyncio
import shutil
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from statemachine import Event, RolloutRequest, SamplingParams, Status
from store.client import RolloutClient
from store.errors import RolloutNotFound
from store.results import RolloutResult

# Sixteen short prompts; more are made by numbering them.
PROMPTS = [
    "the durable rollout", "weights change while", "a worker crashed and",
    "every token is kept", "resume from the prefix", "routing replay needs",
    "the trainer acknowledges", "a lease expires when", "the reaper notices",
    "checkpoints every few tokens", "the append is atomic", "version segments show",
    "greedy decoding must", "nothing is generated twice", "the queue hands out",
    "a group finishes when",
]  # fmt: skip

# Tokens a rollout must have saved on the worker before it is killed: a kill mid-generation.
KILL_AFTER_TOKENS = 8
# ... and at least this many left by its snapshot, so that the kill interrupts it. The snapshot
# lags the engine by up to a checkpoint (the demo's workers save every 8 tokens), so a rollout
# seen with 8 to go has at times made them already. Not more than 8, though: a checkpoint
# waits for its flush point (up to 20 ms, many tiny-model tokens), so the snapshots of a
# 24-token rollout read 0, ~10, ~20, 24, and a window of exactly 8 saved and 16 to go was
# never seen in one test run of three. The worker killed is the one with the most rollouts
# in the window: the others it holds keep the kill mid-generation if one of them has ended.
KILL_BEFORE_END_TOKENS = 8
# How often it looks: a 24-token rollout is in the window for ~8 engine steps, well under
# 0.1 s; at 0.1 s a loaded machine's run once missed every rollout of the step. 32 snapshots
# read every 20 ms cost the demo nothing it shows.
POLL_S = 0.02


@dataclass
class Progress:
    """What the live display and the report read; the loop writes it."""

    step: int = 0
    steps: int = 0
    submitted: int = 0
    consumed: int = 0
    weight_version: int = 0
    weight_updates: int = 0
    worker_kills: int = 0
    notes: list[str] = field(default_factory=list)
    echo: Callable[[str], None] | None = None  # prints each note as it happens (no live display)

    def note(self, text: str) -> None:
        self.notes.append(text)
        if self.echo is not None:
            self.echo(text)


@dataclass(frozen=True, slots=True)
class LoopConfig:
    steps: int
    prompts: int
    samples: int
    max_tokens: int
    kill_step: int  # the step during which a worker is killed


def prompt_texts(k: int) -> list[str]:
    return [
        PROMPTS[i % len(PROMPTS)] + ("" if i < len(PROMPTS) else f" {i // len(PROMPTS)}")
        for i in range(k)
    ]


def perturb(source: Path, target: Path, seed: int, scale: float = 0.05) -> Path:
    """A copy of the checkpoint at ``source`` with each weight moved by ``scale`` of its own
    standard deviation: really different weights (greedy outputs change), same architecture
    and tokenizer, so the CPU engine loads it as the next version."""
    import torch  # noqa: PLC0415  (torch: on demand)
    from safetensors.torch import load_file, save_file  # noqa: PLC0415

    shutil.copytree(source, target, ignore=shutil.ignore_patterns("*.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    for f in sorted(source.glob("*.safetensors")):
        tensors = load_file(f)
        for name, t in tensors.items():
            if t.is_floating_point() and t.numel() > 1:
                noise = torch.randn(t.shape, generator=gen, dtype=torch.float32)
                tensors[name] = (t.float() + scale * t.float().std() * noise).to(t.dtype)
        save_file(tensors, target / f.name, metadata={"format": "pt"})
    return target


async def trainer_loop(
    client: RolloutClient,
    cfg: LoopConfig,
    encode: Callable[[str], list[int]],
    weights: dict[int, Path],
    weights_dir: Path,
    kill: Callable[[set[str]], str],
    progress: Progress,
    events: dict[str, list[Event]],
) -> list[RolloutResult]:
    """Run the steps; returns every rollout's result and fills ``events`` with each one's log
    (read before the acknowledgement deletes it: the report and the picture are drawn from it).
    ``kill`` SIGKILLs one of the named workers, which have rollouts generating, and starts a
    replacement; it returns the killed worker's name."""
    sampling = SamplingParams(max_tokens=cfg.max_tokens, temperature=0.0, ignore_eos=True)
    texts = prompt_texts(cfg.prompts)
    requests = [
        RolloutRequest(prompt_token_ids=tuple(encode(t)), sampling=sampling, metadata={"p": t})
        for t in texts
    ]
    progress.steps = cfg.steps

    async def submit(step: int) -> str:
        batch = await client.submit(requests, n=cfg.samples, batch_id=f"demo-step-{step}")
        progress.submitted += len(batch)
        progress.note(f"submitted step {step + 1}: {cfg.prompts} prompts x {cfg.samples} samples")
        return batch.batch_id

    results: list[RolloutResult] = []
    upcoming = await submit(0)
    for step in range(cfg.steps):
        progress.step = step + 1
        current = upcoming
        if step + 1 < cfg.steps:
            # The next step's rollouts generate while this step's groups are consumed and
            # while the weights change: the update interrupts them.
            upcoming = await submit(step + 1)
        killer = None
        if step == cfg.kill_step:
            # This step's rollouts or the next's: on a loaded machine this step's had all
            # ended before it began (a fresh-clone CI run found nothing left to kill).
            watched = [current] if upcoming == current else [current, upcoming]
            killer = asyncio.create_task(_kill_when_generating(client, watched, kill, progress))
        # The next weights are written meanwhile, so that they are published as soon as the
        # step's last group is in, while the next step's rollouts generate: written after it
        # (torch imported, a checkpoint copied), a loaded machine's update came too late to
        # interrupt anything.
        version = progress.weight_version + 1
        following = (
            asyncio.create_task(
                asyncio.to_thread(
                    perturb, weights[version - 1], weights_dir / f"v{version}", version
                )
            )
            if step + 1 < cfg.steps
            else None
        )
        async for group in client.groups(current, timeout=600):
            results.extend(group.results)
            progress.consumed += len(group.results)
            for r in group.results:
                events[r.rollout_id] = await client.store.events(r.rollout_id)
            await client.ack([r.rollout_id for r in group.results])
        if killer is not None:
            await killer
        if following is not None:
            weights[version] = await following
            await client.publish_weights(version, str(weights[version]))
            progress.weight_version = version
            progress.weight_updates += 1
            progress.note(f"step {step + 1}: published weights v{version}")
    return results


async def _kill_when_generating(
    client: RolloutClient,
    batch_ids: list[str],
    kill: Callable[[set[str]], str],
    progress: Progress,
) -> None:
    ids = [i for b in batch_ids for i in (await client.batch(b)).ids]
    while True:
        # One read for all (the kill follows it at once); one acknowledged meanwhile is
        # deleted: it ended, so it is not generating.
        states = []
        for s in await client.store.load_many(ids):
            if isinstance(s, RolloutNotFound):
                continue
            if isinstance(s, Exception):
                raise s
            states.append(s)
        busy = Counter(
            s.worker_id
            for s in states
            if s.status in (Status.GENERATING, Status.RESUMED)
            and s.worker_id is not None
            and s.num_tokens >= KILL_AFTER_TOKENS
            and s.remaining_tokens >= KILL_BEFORE_END_TOKENS
            # An attempt on the latest weights: its worker is done with the update (the next
            # waits for the kill). A worker still aborting its rollouts for the update held
            # none when killed, and the kill interrupted nothing (no worker_lost abort).
            and s.weight_version == progress.weight_version
        )
        if busy:
            name = kill({busy.most_common(1)[0][0]})
            progress.worker_kills += 1
            progress.note(f"step {progress.step}: SIGKILLed {name} mid-generation")
            return
        if all(s.terminal for s in states):
            progress.note(f"step {progress.step}: nothing generating to kill")
            return
        await asyncio.sleep(POLL_S)
