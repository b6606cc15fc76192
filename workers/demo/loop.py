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
# ... and at least this many left by its snapshot. The snapshot lags the engine by up to a
# checkpoint (the demo's workers save every 8 tokens), so 16 leaves 8 or more really to go:
# with 8, a rollout seen at 16 of 24 had at times made its last tokens already, and the kill
# interrupted nothing (no worker_lost abort; twice in fresh-clone CI runs).
KILL_BEFORE_END_TOKENS = 16
# How often it looks: a 24-token rollout is in that window (8 tokens saved, 16 to go: from
# its 8th token to its 16th) for ~8 engine steps, well under 0.1 s; at 0.1 s a loaded
# machine's run once missed every rollout of the step. 32 snapshots read every 20 ms cost
# the demo nothing it shows.
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
            killer = asyncio.create_task(_kill_when_generating(client, current, kill, progress))
        async for group in client.groups(current, timeout=600):
            results.extend(group.results)
            progress.consumed += len(group.results)
            for r in group.results:
                events[r.rollout_id] = await client.store.events(r.rollout_id)
            await client.ack([r.rollout_id for r in group.results])
        if killer is not None:
            await killer
        if step + 1 < cfg.steps:
            version = progress.weight_version + 1
            path = perturb(weights[version - 1], weights_dir / f"v{version}", seed=version)
            weights[version] = path
            await client.publish_weights(version, str(path))
            progress.weight_version = version
            progress.weight_updates += 1
            progress.note(f"step {step + 1}: published weights v{version}")
    return results


async def _kill_when_generating(
    client: RolloutClient, batch_id: str, kill: Callable[[set[str]], str], progress: Progress
) -> None:
    info = await client.batch(batch_id)
    while True:
        # One read for all (the kill follows it at once); one acknowledged meanwhile is
        # deleted: it ended, so it is not generating.
        states = []
        for s in await client.store.load_many(info.ids):
            if isinstance(s, RolloutNotFound):
                continue
            if isinstance(s, Exception):
                raise s
            states.append(s)
        # Far enough from its end too (KILL_BEFORE_END_TOKENS).
        busy = {
            s.worker_id
            for s in states
            if s.status in (Status.GENERATING, Status.RESUMED)
            and s.worker_id is not None
            and s.num_tokens >= KILL_AFTER_TOKENS
            and s.remaining_tokens >= KILL_BEFORE_END_TOKENS
        }
        if busy:
            name = kill(busy)
            progress.worker_kills += 1
            progress.note(f"step {progress.step}: SIGKILLed {name} mid-generation")
            return
        if all(s.terminal for s in states):
            progress.note(f"step {progress.step}: nothing generating to kill")
            return
        await asyncio.sleep(POLL_S)
