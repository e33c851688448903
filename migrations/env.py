"""Alembic environment: the engine is handed in by gpuflex.db.engine.alembic_config."""

from alembic import context

from gpuflex.db.models import Base

config = context.config
engine = config.attributes["engine"]

with engine.begin() as connection:
    # on_version_apply: a test's hook, to interrupt an upgrade between two revisions
    context.configure(connection=connection, target_metadata=Base.metadata,
                      render_as_batch=True, on_version_apply=config.attributes.get("on_version_apply", ()))
    with context.begin_transaction():
        context.run_migrations()
        if connection.dialect.name == "sqlite":   # foreign keys were off (gpuflex.db.engine): check them
            broken = connection.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
            if broken:   # rolled back: the database stays as it was
                raise RuntimeError(f"the upgrade would leave rows whose foreign keys point nowhere: {broken[:5]}")
