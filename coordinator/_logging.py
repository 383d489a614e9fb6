"""Log output of ``pjrt-rendezvous serve``: plain text lines or JSON lines.

Significant events are logged with ``extra={"event": NAME, ...fields}`` (see
``_monitor``): plain text shows the message; JSON lines carry the message and every field,
so ``jq 'select(.event == "round_late")'`` works without parsing sentences.
"""

from __future__ import annotations

import datetime
import json
import logging
import sys

FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (UTC, ISO 8601), level, logger, message, extra fields."""

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                line[key] = value
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str, ensure_ascii=False)


class _OneLine(logging.Formatter):
    """Plain text; a traceback stays on its own lines but a message never spans two, and
    holds no control character (a carriage return or an escape would forge a line on a
    terminal): each is written as Python writes it in a string (``\\r``, ``\\x1b``)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        if not record.message.isprintable():
            record.message = "".join(
                c if c.isprintable() or c == " " else repr(c)[1:-1] for c in record.message
            )
        return super().formatMessage(record)


def configure(level: str = "INFO", fmt: str = "text", stream=None) -> None:
    """Sends the root logger's output to ``stream`` (default stderr) in ``fmt``.

    Raises:
        ValueError: an unknown format.
    """
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    handler = logging.StreamHandler(sys.stderr if stream is None else stream)
    handler.setFormatter(JsonFormatter() if fmt == "json" else _OneLine(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
