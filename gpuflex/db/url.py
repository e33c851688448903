"""What a database URL says about where its data lives (for the engine and the locks)."""

from __future__ import annotations

import os
from pathlib import Path

import sqlalchemy as sa


def sqlite_path(url: str) -> Path | None:
    """The file behind a sqlite URL (with ~ expanded), or None for other databases."""
    u = sa.engine.make_url(url)
    if u.get_backend_name() != "sqlite" or not u.database or u.database == ":memory:":
        return None
    return Path(os.path.expanduser(u.database))
