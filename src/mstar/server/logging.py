"""Structured logs: JSON lines off a terminal, readable lines on one; no secrets.

Every line logged while a request is handled carries its `request_id` (bound in a context
variable by the server's middleware). Standard-library loggers (uvicorn's) go through the
same processors, so the whole process logs in one format.

Redaction: values of secret-looking keys (`authorization`, `api_key`, `password`, `token`,
`secret`), `Bearer ...` credentials and every configured secret string are replaced by
``[redacted]`` wherever they appear in a line, exception text included.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Iterable, MutableMapping
from typing import Any, TextIO

import structlog
from structlog.typing import EventDict, Processor

__all__ = ["SecretRedactor", "configure_logging"]

REDACTED = "[redacted]"
_SECRET_KEYS = re.compile(
    r"(authorization|api[_-]?key|password|passwd|secret|token)$", re.IGNORECASE
)
_BEARER = re.compile(r"(Bearer\s+)[^\s\"',;]+", re.IGNORECASE)


class SecretRedactor:
    """A structlog processor that removes credentials from a log line.

    Args:
        secrets: Literal strings (e.g. the server's API key) to remove wherever they appear.
    """

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        self.secrets = tuple(s for s in secrets if s)

    def __call__(self, logger: Any, method: str, event: EventDict) -> EventDict:
        """Redact the event dict in place and return it."""
        for key, value in list(event.items()):
            if key.startswith("_"):
                continue  # structlog's own bookkeeping (the stdlib record)
            if _SECRET_KEYS.search(key):
                event[key] = REDACTED
            else:
                event[key] = self._scrub(value)
        return event

    def _scrub(self, value: Any) -> Any:
        if isinstance(value, str):
            value = _BEARER.sub(r"\1" + REDACTED, value)
            for secret in self.secrets:
                value = value.replace(secret, REDACTED)
            return value
        if isinstance(value, MutableMapping):
            return {
                k: REDACTED if isinstance(k, str) and _SECRET_KEYS.search(k) else self._scrub(v)
                for k, v in value.items()
            }
        if isinstance(value, list | tuple):
            return type(value)(self._scrub(v) for v in value)
        return value


def _is_terminal(stream: TextIO) -> bool:
    """Return whether ``stream`` is a terminal; file-like objects without ``isatty`` are not."""
    isatty = getattr(stream, "isatty", None)
    return bool(isatty()) if callable(isatty) else False


def configure_logging(
    level: str = "info",
    *,
    json: bool | None = None,
    stream: TextIO | None = None,
    secrets: Iterable[str] = (),
) -> None:
    """Route structlog and the standard `logging` module to one handler.

    Args:
        level: Lowest level logged ("debug", "info", "warning", "error").
        json: JSON lines (True) or console lines (False); None picks JSON unless ``stream``
            is a terminal.
        stream: Where lines go (standard error by default).
        secrets: Strings that must never appear in a log line.
    """
    stream = stream or sys.stderr
    if json is None:
        json = not _is_terminal(stream)
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}: use debug, info, warning or error")
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
        # Exceptions become text before redaction, so their messages are scrubbed too.
        structlog.processors.format_exc_info,
        SecretRedactor(secrets),
    ]
    renderer: Processor = (
        structlog.processors.JSONRenderer()
        if json
        else structlog.dev.ConsoleRenderer(colors=_is_terminal(stream))
    )
    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            *shared,
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    handler = logging.StreamHandler(stream)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(numeric)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
