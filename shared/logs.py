"""Log lines of every service: `text` for people (the default) or `json`, one object per line
for log pipelines, with time, level, service, logger, message and, when the line concerns a
request, its `request_id`.

A line concerns a request when `request_id_var` is set (the gateway sets it for each HTTP
request) or the call passes one: `log.info("request finished", extra={"request_id": rid})`.
Other `extra` fields go into the JSON object as they are.
"""

from __future__ import annotations

import json
import logging
import time
from contextvars import ContextVar

LOG_FORMATS = ("text", "json")
request_id_var: ContextVar[str | None] = ContextVar("request_id", default=None)

_RECORD_FIELDS = set(vars(logging.makeLogRecord({}))) | {
    "message",
    "asctime",
    "request_id",
    "color_message",  # uvicorn's
    "taskName",
}


class RequestIdFilter(logging.Filter):
    """Sets `record.request_id` from `request_id_var` unless the call passed one."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = request_id_var.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line; times in UTC (RFC 3339)."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None)
        if request_id is not None:
            entry["request_id"] = request_id
        entry.update({k: v for k, v in vars(record).items() if k not in _RECORD_FIELDS})
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """`time level service logger [request id] message`."""

    def __init__(self, service: str) -> None:
        super().__init__(f"%(asctime)s %(levelname)s {service} %(name)s%(rid)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        request_id = getattr(record, "request_id", None)
        record.rid = f" [{request_id}]" if request_id is not None else ""
        return super().format(record)


def setup_logging(level: str, service: str, log_format: str = "text") -> None:
    """Root logger to stderr in `log_format`; uvicorn's loggers go through it too."""
    handler = logging.StreamHandler()
    formatter = JsonFormatter(service) if log_format == "json" else TextFormatter(service)
    handler.setFormatter(formatter)
    handler.addFilter(RequestIdFilter())
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
