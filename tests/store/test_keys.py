"""The id rule is one rule: what ``check_rollout_id`` takes is exactly what the API's document
says (``ID_PATTERN``, read as ECMA-262 by a JSON Schema client, here ``jsonschema_rs``), over
every code point; and no id holds a control character (ESC would reach terminals via logs)."""

from __future__ import annotations

import jsonschema_rs
import pytest

from store.errors import InvalidRolloutId
from store.keys import ID_PATTERN, check_batch_id, check_rollout_id


def _python_takes(ch: str) -> bool:
    try:
        check_rollout_id(f"a{ch}b")
    except InvalidRolloutId:
        return False
    return True


def test_the_check_and_the_documented_pattern_agree_on_every_code_point() -> None:
    pattern = jsonschema_rs.validator_for({"type": "string", "pattern": ID_PATTERN})
    points = (chr(c) for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF)
    disagree = [hex(ord(ch)) for ch in points if pattern.is_valid(f"a{ch}b") != _python_takes(ch)]
    assert disagree == []


REFUSED = [*map(chr, range(0x21)), *map(chr, range(0x7F, 0xA1)), "\u2028", "\u3000", "\ufeff",
           "{", "}", ":"]  # fmt: skip


@pytest.mark.parametrize("ch", REFUSED)
def test_control_characters_whitespace_braces_and_colons_are_refused(ch: str) -> None:
    with pytest.raises(InvalidRolloutId, match="control characters"):
        check_rollout_id(f"run{ch}1")
    with pytest.raises(InvalidRolloutId):
        check_batch_id(f"run{ch}1")


def test_everything_else_is_taken() -> None:
    for ch in ("é", "ß", "日", "🙂", ".", "-", "_", "/", "\u200b"):  # the last: no whitespace
        assert check_rollout_id(f"run{ch}1") == f"run{ch}1"
