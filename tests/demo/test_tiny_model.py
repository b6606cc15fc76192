"""The tiny model builder: deterministic, standard HF directories, loadable offline, CLI."""

from __future__ import annotations

import os

# Before transformers is imported: nothing in this suite may reach a hub.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from workers.cli import build_parser
from workers.demo.tiny_model import EOS_TOKEN, make_tiny_checkpoint, make_tiny_model

# Builds and loads real tiny models through the CLI: the full suite's tier.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


def read_all(path: Path) -> dict[str, bytes]:
    return {name: (path / name).read_bytes() for name in FILES}


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_same_seed_gives_identical_bytes(tmp_path: Path, moe: bool) -> None:
    a = make_tiny_model(tmp_path / "a", moe=moe, seed=5)
    b = make_tiny_model(tmp_path / "b", moe=moe, seed=5)
    assert read_all(a) == read_all(b)


def test_another_checkpoint_changes_only_the_weights(tmp_path: Path) -> None:
    base = make_tiny_model(tmp_path / "base", moe=True, seed=0)
    other = make_tiny_checkpoint(tmp_path / "other", like=base, seed=1)
    a, b = read_all(base), read_all(other)
    assert a["model.safetensors"] != b["model.safetensors"]
    assert {k: v for k, v in a.items() if k != "model.safetensors"} == {
        k: v for k, v in b.items() if k != "model.safetensors"
    }


@pytest.mark.parametrize(
    ("moe", "architecture"), [(False, "Qwen3ForCausalLM"), (True, "Qwen3MoeForCausalLM")]
)
def test_loads_offline_with_auto_classes(tmp_path: Path, moe: bool, architecture: str) -> None:
    path = make_tiny_model(tmp_path / "m", moe=moe)
    config = AutoConfig.from_pretrained(path)
    assert config.architectures == [architecture]
    model = AutoModelForCausalLM.from_pretrained(path)
    assert type(model).__name__ == architecture
    assert next(model.parameters()).dtype == torch.float32
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.eos_token == EOS_TOKEN
    assert tokenizer.eos_token_id == config.eos_token_id
    assert len(tokenizer) == config.vocab_size
    text = "The rollout engine resumed 4217 tokens."
    ids = tokenizer(text).input_ids
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text) / 2  # BPE merges learned, not bytes
    generation = json.loads((path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tokenizer.eos_token_id
    portable = json.loads((path / "tokenizer_config.json").read_text())
    assert portable["tokenizer_class"] == "PreTrainedTokenizerFast"


def test_cli_make_tiny_model(tmp_path: Path) -> None:
    """`rollouts make-tiny-model DIR --moe --seed N`, in a fresh process: same bytes."""
    out = tmp_path / "cli"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "workers.cli", "make-tiny-model", str(out), "--moe", "--seed", "3"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(out)
    assert read_all(out) == read_all(make_tiny_model(tmp_path / "here", moe=True, seed=3))


def test_cli_refuses_bad_arguments() -> None:
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["make-tiny-model"])  # DIR is required
    with pytest.raises(SystemExit):
        parser.parse_args(["no-such-command"])
    args = parser.parse_args(["make-tiny-model", "d", "--seed", "2"])
    assert (args.dir, args.moe, args.seed) == ("d", False, 2)
