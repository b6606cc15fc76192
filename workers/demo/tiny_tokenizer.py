"""The tiny models' tokenizer (``tiny_model``): a byte-level BPE trained here on text generated
in code, never downloaded. Apart from ``tiny_model`` and without torch or transformers, so
that a test needing only a tokenizer directory (an API's ``--tokenizer``) builds one in a
fraction of a second: ``make_tiny_tokenizer``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# Special tokens in Qwen's spelling, so chat-style prompts look familiar; the eos token is
# what generation stops on.
EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (EOS_TOKEN, "<|im_start|>", "<|im_end|>")
VOCAB_SIZE = 2048

_VOCABULARY_TEXT = (
    "the a an rollout token model weight trainer worker engine queue redis event log state "
    "abort resume finish stop length sample greedy expert router layer batch step prompt "
    "alpha beta gamma delta river mountain cloud stone light shadow quick slow bright dark "
    "one two three four five six seven eight nine ten and or but if then else while for "
    "is was will be has had can may must should run ran runs walk walked see saw seen"
)


def _corpus(seed: int, n_lines: int = 4000) -> list[str]:
    """Pseudo-random sentences plus digits and punctuation, so BPE learns merges of every kind."""
    rng = random.Random(seed)
    vocabulary = _VOCABULARY_TEXT.split()
    lines = []
    for _ in range(n_lines):
        words = [rng.choice(vocabulary) for _ in range(rng.randint(3, 14))]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 99999)))
        lines.append(" ".join(words).capitalize() + rng.choice(".!?,;:"))
    return lines


# A chat template in Qwen2.5's form, tools included (``make_tiny_tokenizer(chat_template=...)``;
# the tiny model's own tokenizer has no template): the tools in the system turn, an assistant's
# calls as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (what the ``hermes``
# parser reads back), tool results as ``<tool_response>`` in a user turn. Qwen's text and
# layout, so a prompt built on it splits into turns exactly where Qwen's would.
TOOL_CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query."
    "\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n"
    "<tools>' }}{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name "
    'and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": '
    '<function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' }}{{- tool_call.name }}{{- \'", "arguments": \' }}'
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}"
    "{%- endif %}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def train_tokenizer(seed: int = 0) -> Tokenizer:
    """A byte-level BPE of about VOCAB_SIZE tokens, trained on generated text."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    return tok


def write_tokenizer_config(out: Path, chat_template: str | None = None) -> None:
    """Replace the release-specific tokenizer_config.json with a portable one.

    transformers 5 writes `"tokenizer_class": "TokenizersBackend"`, which transformers 4 (and
    so vLLM builds pinned to it) cannot resolve; `PreTrainedTokenizerFast` over tokenizer.json
    loads in both. ``chat_template``: the template ``apply_chat_template`` uses (the tiny
    tokenizer has none of its own).
    """
    config: dict[str, object] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    # Older releases also read special_tokens_map.json; keep it consistent if one was written.
    (out / "special_tokens_map.json").unlink(missing_ok=True)


def make_tiny_tokenizer(path: str | Path, *, chat_template: str | None = None) -> Path:
    """Write the tiny models' tokenizer alone (tokenizer.json, tokenizer_config.json) at
    ``path``, as ``AutoTokenizer.from_pretrained`` loads it, and return it."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    train_tokenizer(seed=0).save(str(out / "tokenizer.json"))
    write_tokenizer_config(out, chat_template)
    return out
