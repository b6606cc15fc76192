"""Structured logs for every long-running process (workers, the API).

A line that matters (start, abort, resume, takeover, weight load, failure) names what
happened and carries its identifiers as fields, never only inside the message text::

    log_event(log, logging.INFO, "abort", "rollout aborted: weight update",
              rollout_id=rid, attempt=3, worker=name, reason="weight_update")

``--log-format text`` (the default, for people) prints them after the message as
``key=value``; ``--log-format json`` prints one JSON object per line for log shippers
(Loki, Elasticsearch, CloudWatch), with the same fields as keys. Nothing logs per token.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

LOG_FORMATS = ("text", "json")


def add_log_format(parser: Any) -> None:
    """Every service command's ``--log-format`` (an ``argparse`` parser)."""
    parser.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default="text",
        help="text for people, or json: one object per line for log shippers (default %(default)s)",
    )


# What every LogRecord has; anything else on a record came from ``extra=`` and is a field.
_STANDARD = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "taskName"}


def fields_of(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in record.__dict__.items() if k not in _STANDARD}


def log_event(logger: logging.Logger, level: int, event: str, message: str, **fields: Any) -> None:
    """Log ``message`` as the event ``event`` with ``fields`` (rollout_id, attempt, worker...)."""
    if logger.isEnabledFor(level):
        logger.log(level, message, extra={"event": event, **fields})


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extra = fields_of(record)
        if not extra:
            return line
        pairs = " ".join(f"{k}={_text(v)}" for k, v in extra.items())
        head, sep, trace = line.partition("\n")  # fields stay on the message's line
        return f"{head} {pairs}{sep}{trace}"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 6),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update(fields_of(record))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, separators=(",", ":"))


def _text(value: Any) -> str:
    s = str(value)
    return json.dumps(s) if (" " in s or not s) else s


def configure(fmt: str = "text", level: int = logging.INFO) -> None:
    """Route the root logger to stderr in ``fmt`` ("text" or "json"); replaces earlier
    handlers so a process configures its logs exactly once, whatever ran before."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, got {fmt!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level)
