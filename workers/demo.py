"""``rollouts demo``: durable generation end to end on a tiny local model, in about a minute.

It starts a redis-server of its own with AOF ``appendfsync always`` (unless given a Redis URL
with ``--redis`` or ``--redis-url-file``; ``$ROLLOUTS_REDIS_URL`` is ignored here, so the demo
never writes into a deployment's Redis by accident), builds a tiny random-weight
Qwen3-MoE model (no download), starts two worker processes,
submits greedy rollouts, stops one worker with SIGTERM while it is generating, and shows that
its rollouts resumed on the other worker from the saved tokens and ended exactly as an
uninterrupted run of the same engine does, with one routed-experts row per token.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from statemachine import RolloutRequest, SamplingParams
from store.client import RolloutClient
from store.connection import URL_ENV, redact
from store.errors import InvalidRedisUrl
from store.redis_server import RedisServer
from workers import redis_options, worker_cli

PROMPTS = [
    "the durable rollout",
    "weights change while",
    "a worker crashed and",
    "every token is kept",
    "resume from the prefix",
    "routing replay needs",
]


def configure(parser: argparse.ArgumentParser) -> None:
    redis_options.add_arguments(
        parser, otherwise="start a redis-server of its own", use_env=False
    )
    parser.add_argument("--model", help="model directory (default: build the tiny MoE model)")
    parser.add_argument(
        "--max-tokens", type=int, default=48, help="tokens each demo rollout generates (default 48)"
    )


def _cache_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "durable-rollouts"


def _model(path: str | None) -> Path:
    if path:
        return Path(path)
    target = _cache_dir() / "tiny-qwen3-moe-seed0"
    if not (target / "config.json").exists():
        from workers.tiny_model import make_tiny_model  # noqa: PLC0415  (torch: on demand)

        print(f"building the tiny MoE model in {target} (random weights, no download)")
        make_tiny_model(target, moe=True, seed=0)
    return target


def _start_worker(url: str, model: Path, name: str, log: Path) -> subprocess.Popen[bytes]:
    # The URL travels in the environment: on the command line `ps` would show its password.
    cmd = worker_cli.command(None, model, name, "--checkpoint-tokens", "8", concurrency=2)
    env = {**os.environ, URL_ENV: url}
    return subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)


async def _demo(url: str, model: Path, max_tokens: int, logs: Path) -> int:
    from transformers import AutoTokenizer  # noqa: PLC0415

    tok = AutoTokenizer.from_pretrained(model)
    requests = [
        RolloutRequest(
            prompt_token_ids=tuple(tok.encode(p)),
            sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
            metadata={"prompt": p},
        )
        for p in PROMPTS
    ]
    client = RolloutClient(url, tokenizer=tok)
    a = _start_worker(url, model, "demo-worker-a", logs / "worker-a.log")
    b = None
    try:
        ids = await client.submit(requests)
        print(f"submitted {len(ids)} rollouts; worker A generates 2 at a time")
        # Wait until worker A has checkpointed some tokens, then stop it mid-generation.
        while True:
            states = [await client.store.load(rid) for rid in ids]
            if any(s.worker_id == "demo-worker-a" and s.num_tokens >= 8 for s in states):
                break
            await asyncio.sleep(0.05)
        a.send_signal(signal.SIGTERM)
        a.wait(60)
        print("stopped worker A with SIGTERM mid-generation; starting worker B")
        b = _start_worker(url, model, "demo-worker-b", logs / "worker-b.log")
        results = await client.wait(ids, timeout=300)
    finally:
        for p in (a, b):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(60)
        await client.aclose()

    reference = await _uninterrupted(model, requests)
    print(
        f"\n{'rollout':10} {'status':7} {'tokens':>6} {'attempts':>8} {'aborts':>6} "
        f"{'routes':>12}  same as uninterrupted"
    )
    ok = True
    for r, ref in zip(results, reference, strict=True):
        same = np.array_equal(r.response_token_ids, ref)
        ok &= same and r.status == "done"
        routes = "-" if r.routed_experts is None else "x".join(map(str, r.routed_experts.shape))
        print(
            f"{r.rollout_id[:8]:10} {r.status:7} {len(r.response_token_ids):6d} "
            f"{r.attempts:8d} {r.aborts:6d} {routes:>12}  {'yes' if same else 'NO'}"
        )
    resumed = sum(r.aborts > 0 for r in results)
    print(
        f"\n{resumed} rollouts were interrupted and resumed; "
        f"{'all' if ok else 'NOT all'} match the uninterrupted greedy run token for token."
    )
    print(f"text of the first: {results[0].metadata['prompt']!r} -> {results[0].text!r}")
    return 0 if ok and resumed else 1


async def _uninterrupted(model: Path, requests: list[RolloutRequest]) -> list[np.ndarray]:
    from workers.engines.base import EngineRequest, join_chunks  # noqa: PLC0415
    from workers.engines.cpu.engine import CpuEngine  # noqa: PLC0415

    engine = CpuEngine(model)
    try:
        out = []
        for i, req in enumerate(requests):
            chunks = [
                c
                async for c in engine.generate(
                    EngineRequest(
                        request_id=f"ref-{i}",
                        prompt_token_ids=req.prompt_token_ids,
                        sampling=req.sampling,
                    )
                )
            ]
            out.append(join_chunks(chunks).token_ids)
        return out
    finally:
        await engine.close()


def run(args: argparse.Namespace) -> int:
    try:
        url = redis_options.resolve(args, use_env=False)
    except InvalidRedisUrl as exc:
        # Its message names the file, never the URL.
        print(f"rollouts demo: error: {exc}", file=sys.stderr)
        return 2
    model = _model(args.model)
    with tempfile.TemporaryDirectory(prefix="rollouts-demo-") as tmp:
        logs = Path(tmp)
        if url:
            print(f"using Redis at {redact(url)}")
            return asyncio.run(_demo(url, model, args.max_tokens, logs))
        with RedisServer(logs / "redis") as server:
            print(f"started redis-server on {redact(server.url)} (AOF, appendfsync always)")
            t0 = time.monotonic()
            code = asyncio.run(_demo(server.url, model, args.max_tokens, logs))
            print(f"demo took {time.monotonic() - t0:.1f} s")
            return code
