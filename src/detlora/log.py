"""detlora's log: standard ``logging`` under the ``detlora`` logger.

The level comes from ``DETLORA_LOGGING_LEVEL`` (default INFO); records go to stderr as
``INFO 12-01 10:00:00 detlora.engine: message``. Set ``DETLORA_CONFIGURE_LOGGING=0`` to leave
the ``detlora`` logger to the application's own configuration.
"""

from __future__ import annotations

import logging
import os
import sys

_FORMAT = "%(levelname)s %(asctime)s %(name)s: %(message)s"
_configured = False


def get_logger(name: str) -> logging.Logger:
    """The logger of a detlora module (``detlora.<area>``), configured on first use."""
    _configure()
    return logging.getLogger(name if name.startswith("detlora") else f"detlora.{name}")


def _configure() -> None:
    global _configured
    if _configured:
        return
    _configured = True
    if os.environ.get("DETLORA_CONFIGURE_LOGGING", "1") == "0":
        return
    root = logging.getLogger("detlora")
    level = os.environ.get("DETLORA_LOGGING_LEVEL", "INFO").upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise ValueError(f"DETLORA_LOGGING_LEVEL must be one of DEBUG, INFO, WARNING, ERROR, "
                         f"CRITICAL, got {level!r}")
    root.setLevel(level)
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%m-%d %H:%M:%S"))
        root.addHandler(handler)
    root.propagate = False
