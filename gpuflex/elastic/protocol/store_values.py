"""Checks of the values the coordinator reads from outside itself before it acts on them
or shows them: a list of worker ids (a resize's members), rank 0's progress record.

The job store and the control socket are written by processes the coordinator does not
trust to be well-formed (a buggy script, a peer that sends garbage): a value that fails
these checks is refused or ignored, never a crash of the generation logic.
"""

from __future__ import annotations

import json
from typing import Any

MAX_WID = 2**31 - 1


def is_id_list(value: Any) -> bool:
    """A non-empty list of worker ids (ints in 0..MAX_WID, not bools)."""
    return isinstance(value, list) and bool(value) and all(
        isinstance(w, int) and not isinstance(w, bool) and 0 <= w <= MAX_WID for w in value)


def progress_record(raw: bytes) -> dict[str, Any] | None:
    """Rank 0's progress (unsigned: shown, never acted on); None unless a JSON object."""
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
