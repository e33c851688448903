from __future__ import annotations

import typer

from gpuflex.cli.common import command, console, obj

app = typer.Typer(help="Database maintenance.\n\nExample: gpuflex db upgrade", no_args_is_help=True)


@app.command("upgrade")
@command
def upgrade(ctx: typer.Context) -> None:
    """Apply the database migrations (also done automatically on first use).

    Example: gpuflex db upgrade
    """
    from gpuflex.db.engine import current_revision, make_engine, upgrade as run_upgrade

    cfg = obj(ctx).config()
    engine = make_engine(cfg.database_url)
    ran = run_upgrade(engine)
    rev = current_revision(engine)
    console.print(f"database {engine.url.database}: {'upgraded to' if ran else 'already at'} revision {rev}")
