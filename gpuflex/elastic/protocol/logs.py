"""Where the runtime's and the coordinator's log lines go, and an exception in one line.

The library logs through module loggers under "gpuflex" and leaves handlers to whoever
runs it. A worker or coordinator process started by gpuflex has nobody else to choose: its
lines must reach its log file (`gpuflex logs` shows them, tests and users grep them), so
the process installs one plain handler, unless the script already put one on "gpuflex".
"""

from __future__ import annotations

import logging
from typing import TextIO

ROOT = "gpuflex"


def ensure_handler(stream: TextIO) -> None:
    """Write gpuflex's INFO lines to `stream` as bare messages, as `print` did; nothing if
    a handler is already configured on the "gpuflex" logger."""
    logger = logging.getLogger(ROOT)
    if logger.handlers:
        return
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False   # the script's own root handler would print each line twice


def describe(e: BaseException, limit: int = 200) -> str:
    """An exception in one line for a log or a record: its type and the first line of its
    message, at most `limit` characters of it (torch's errors run to pages)."""
    text = str(e)
    return f"{type(e).__name__}: {text.splitlines()[0][:limit] if text.strip() else ''}".rstrip()
