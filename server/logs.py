"""The server's logging: text or JSON lines on stderr, each line tagged with its process."""

from __future__ import annotations

import logging


def setup_logging(level: str, fmt: str, role: str = "") -> None:
    """Root logging to stderr as text, or as JSON lines (python-json-logger); ``role`` tags
    every line of a second process (a front or the learner process)."""
    handler = logging.StreamHandler()
    if fmt == "json":
        from pythonjsonlogger.json import JsonFormatter
        handler.setFormatter(JsonFormatter("%(asctime)s %(levelname)s %(name)s %(message)s",
                                           rename_fields={"levelname": "level",
                                                          "asctime": "time"},
                                           static_fields={"process": role} if role else None))
    else:
        tag = f" [{role}]" if role else ""
        handler.setFormatter(logging.Formatter(
            f"%(asctime)s %(levelname)s %(name)s{tag}: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler], force=True)
