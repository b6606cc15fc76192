"""schemathesis (the real package, its CLI) against the document a real ``rollouts api`` process
serves, over a real redis-server: every phase (coverage: the boundaries of every constraint;
fuzzing; stateful sequences through the document's links), every check: no 5xx, statuses,
content types, headers and bodies as documented, valid requests accepted and invalid ones
refused (so the document says exactly what the handlers take), and the bearer token enforced.
Its hooks (``schemathesis_hooks.py``) read msgpack and NDJSON answers, keep result streams
short and generation small, and keep bodies generated as valid within the few constraints
JSON Schema cannot state.

Two APIs, two documents: one without ``--tokenizer`` (prompts as token ids only; chat not
served) and one with the tiny models' tokenizer and its Qwen-style chat template (text prompts,
chat with tools; a template that renders none is checked by ``test_openai_contract``). One
real worker process (the synthetic engine: no model, no cost) answers the harness calls
(``/v1/completions``, ...), which wait for their rollouts: a valid call is answered 200 well
within the run's request timeout, and one that is not is answered 504 by the API's
``--call-timeout`` (a 5xx: a finding) before the client gives up.

Coverage is whole but for the submit's; the rest is bounded by ``--max-time`` (``RUNS``); a fixed
seed, so that a finding reproduces.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from store.redis_server import RedisServer, free_port
from tests.api.test_process import TOKEN, api_command, wait_healthy
from tests.workers.helpers import start_worker, stop
from workers.demo.tiny_tokenizer import TOOL_CHAT_TEMPLATE, make_tiny_tokenizer

REPO = Path(__file__).resolve().parents[2]
SEED = 28
# The first API (without a tokenizer) has every operation tested; the second (with one) the
# operations whose document the tokenizer changes, and those their links lead to. Each in
# three runs with budgets of their own, so that no phase starves another (with one budget
# shared, a loaded CI run's Coverage took all of the tokenizer API's 45 s, and 90 s when given
# 90, and left Fuzzing and Stateful none: a failed run without a finding):
# - Coverage of every operation but the submit, whole (no budget: ~1,600 cases, ~10 s here);
# - Coverage of the submit within a budget: its nested body has ~7,000 boundary cases (~40 s),
#   each a valid batch the worker then generates, too many to send whole on every run (on a
#   loaded CI run its first case took more than 10 s to come);
# - Fuzzing and Stateful within a budget.
# Each: its name, its phases, its budget by API (none: whole) and the least cases it sends
# (a hundred or more; the submit's Coverage at least one, its budget may go to a loaded
# machine's CPU).
RUNS: list[tuple[str, str, dict[str, int], int]] = [
    ("coverage", "examples,coverage", {}, 100),
    ("coverage of the submit", "coverage", {"bare": 30, "tokenizer": 30}, 1),
    ("fuzzing", "fuzzing,stateful", {"bare": 20, "tokenizer": 25}, 100),
]
REQUEST_TIMEOUT_S = 5
CALL_TIMEOUT_S = 4  # a call not answered by then is a 504, not a client timeout
# The worker: unpaced, 16 tokens a step; a context of 512 tokens, so that a call whose
# max_tokens is null ("what the context leaves") ends quickly too.
SYNTHETIC = {"token_delay_s": 0.0, "tokens_per_chunk": 16, "context_length": 512}
# /pause would stop the worker every later call waits for (its modes and /resume are tested
# by tests/api/harness against the same document).
NOT_FUZZED_PATHS = ("pause", "resume")  # one operation each
NOT_FUZZED = rf"^/({'|'.join(NOT_FUZZED_PATHS)})$"


def schemathesis(
    base: str,
    env: dict[str, str],
    cwd: Path,
    phases: str,
    max_time: int | None,
    only: list[str] | None = None,
    hook_env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """The CLI's run of ``phases`` against ``base``; ``only``: these operations (by
    operationId); ``hook_env``: what the hooks are told (the API's tokenizer)."""
    hook_env = hook_env or {}
    budget = ["--max-time", str(max_time)] if max_time is not None else []
    only_args = ["--include-operation-id-regex", f"^({'|'.join(only)})$"] if only else []
    return subprocess.run(
        [sys.executable, "-m", "schemathesis.cli", "run", f"{base}/openapi.json",
         "--checks", "all", "--phases", phases, *budget, "--seed", str(SEED), *only_args,
         "--exclude-path-regex", NOT_FUZZED,
         "--workers", "1", "--request-timeout", str(REQUEST_TIMEOUT_S), "--header",
         f"Authorization: Bearer {TOKEN}"],
        env={**env, "SCHEMATHESIS_HOOKS": "tests.api.schemathesis_hooks", "NO_COLOR": "1",
             "SCHEMATHESIS_CONTEXT": str(SYNTHETIC["context_length"]), **hook_env},
        cwd=cwd, capture_output=True, text=True, timeout=(max_time or 600) + 60,
        check=False,  # its exit status is asserted below, with its report
    )  # fmt: skip


def assert_clean(
    run: subprocess.CompletedProcess[str], what: str, every: bool, phases: str, least: int
) -> None:
    out = f"{what}:\n{run.stdout}{run.stderr}"
    assert run.returncode == 0, findings(out)
    # Every phase ran (Examples: the document has none), every operation selected (``every``:
    # all) was tested, and ``least`` requests or more were sent (~1,000 in 20 s here).
    for phase in (p.capitalize() for p in phases.split(",") if p != "examples"):
        assert f"✅  {phase}" in out, out[-3000:]
    selected = re.search(r"Selected: (\d+)/(\d+)\s+Tested: (\d+)", out)
    assert selected is not None and selected[1] == selected[3], out[-3000:]
    assert int(selected[2]) - int(selected[1]) == len(NOT_FUZZED_PATHS) or not every, out[-3000:]
    counts = re.search(r"(\d+) generated, (\d+) passed", out)
    assert counts is not None and int(counts[1]) == int(counts[2]) >= least, out[-3000:]
    times = re.findall(r"(Coverage|Fuzzing|Stateful) \(in ([\d.]+)s\)", out)
    print(what, counts[0], ", ".join(f"{phase} {s} s" for phase, s in times))


def findings(out: str) -> str:
    """The report's failures and summary, each line cut short: a fuzzed body can be longer than
    a whole assertion message, and the tail alone would show only the last request's end."""
    start = out.find("= FAILURES =")
    lines = out[start if start >= 0 else 0 :].splitlines()
    return "\n".join(line if len(line) <= 1500 else f"{line[:1500]} [...]" for line in lines)


def _ops(what: str, ops: list[str]) -> list[str]:
    """The operations a run of ``RUNS`` tests, of those ``ops`` selected."""
    if what == "coverage of the submit":
        return ["submit"]
    return [op for op in ops if op != "submit"] if what == "coverage" else ops


def changed(doc: dict[str, Any], before: dict[str, Any]) -> list[str]:
    """The operations of ``doc`` that ``before`` has not, or not alike (themselves or any
    schema they refer to), and those their links lead to."""
    ops = _operations(doc)
    old = _operations(before)
    out = {name for name, op in ops.items() if _meaning(op, doc) != _meaning(old.get(name), before)}
    for name in list(out):
        for response in ops[name]["responses"].values():
            out.update(link["operationId"] for link in response.get("links", {}).values())
    return sorted(out)


def _operations(doc: dict[str, Any]) -> dict[str, Any]:
    return {op["operationId"]: op for ops in doc["paths"].values() for op in ops.values()}


def _meaning(node: Any, doc: dict[str, Any]) -> Any:
    """``node`` and every component schema it refers to, transitively."""
    seen: dict[str, Any] = {}
    todo = [node]
    while todo:
        text = json.dumps(todo.pop(), sort_keys=True)
        for name in re.findall(r'"#/components/schemas/([^"]+)"', text):
            if name not in seen:
                seen[name] = doc["components"]["schemas"][name]
                todo.append(seen[name])
    return json.dumps([node, seen], sort_keys=True)


async def fetch(base: str, path: str) -> str:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with aiohttp.ClientSession() as http, http.get(f"{base}{path}", headers=auth) as r:
        assert r.status == 200, path
        return await r.text()


async def answered(base: str) -> dict[str, float]:
    """Route -> requests answered 200 (the API's own metrics)."""
    text = await fetch(base, "/metrics")
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"rollouts_api_requests_total\{(.*)\} (\S+)$", line)
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m[1])) if m else {}
        if labels.get("status") == "200":
            out[labels["route"]] = out.get(labels["route"], 0) + float(m[2])  # type: ignore[index]
    return out


@pytest.mark.slow  # ~150 s: six runs (three to their budgets), four processes' start
async def test_schemathesis_finds_no_drift_and_no_5xx(tmp_path: Path) -> None:
    tokenizer = make_tiny_tokenizer(tmp_path / "tokenizer", chat_template=TOOL_CHAT_TEMPLATE)
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "ROLLOUTS_API_TOKEN": TOKEN, "PYTHONPATH": path}
    with RedisServer(tmp_path / "redis", config={"appendfsync": "everysec"}) as server:
        worker = start_worker(server.url, None, "sw1", tmp_path / "worker.log",
                              "--checkpoint-tokens", "64", concurrency=16, synthetic=SYNTHETIC,
                              env={"PYTHONPATH": path})  # fmt: skip
        apis = {}
        try:
            for name, extra in (("bare", ()), ("tokenizer", ("--tokenizer", str(tokenizer)))):
                port, log = free_port(), tmp_path / f"api-{name}.log"
                cmd = api_command(server.url, port, "--call-timeout", str(CALL_TIMEOUT_S), *extra)
                proc = subprocess.Popen(cmd, env=env, stdout=log.open("wb"),
                                        stderr=subprocess.STDOUT)  # fmt: skip
                apis[name] = (f"http://127.0.0.1:{port}", proc, log)
            runs, served, docs = {}, {}, {}
            for name, (base, proc, log) in apis.items():
                # The tokenizer's API imports transformers: it comes up during the first run.
                await wait_healthy(base, proc, log, timeout=90)
                docs[name] = json.loads(await fetch(base, "/openapi.json"))
                only = changed(docs[name], docs["bare"]) if name != "bare" else None
                told = {"SCHEMATHESIS_TOKENIZER": str(tokenizer)} if name != "bare" else {}
                ops = only or sorted(_operations(docs[name]))
                runs[name] = [
                    (what, phases, least, schemathesis(base, env, tmp_path, phases,
                                                       budget.get(name), _ops(what, ops), told))
                    for what, phases, budget, least in RUNS
                ]  # fmt: skip
                served[name] = await answered(base)
        finally:
            stop(worker, *(proc for _, proc, _ in apis.values()))
    # What the tokenizer changes: submit's prompts, completions' prompt, chat served (and the
    # operations the submit's links lead to).
    assert {"submit", "completions", "chat_completions"} <= set(
        changed(docs["tokenizer"], docs["bare"])
    )
    for name, api_runs in runs.items():
        for what, phases, least, run in api_runs:
            every = name == "bare" and what == "fuzzing"
            assert_clean(run, f"the API {name}, {what}", every, phases, least)
    for name, (_, _, log) in apis.items():
        assert "unexpected error" not in log.read_text(), name
    # The calls were served (the worker answered them), not merely refused; chat only where
    # the API has a tokenizer (elsewhere it is neither served nor documented).
    assert served["bare"]["/v1/completions"] > 0, served
    assert "/v1/chat/completions" not in served["bare"], served
    assert min(served["tokenizer"]["/v1/completions"],
               served["tokenizer"]["/v1/chat/completions"]) > 0, served  # fmt: skip
