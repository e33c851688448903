"""Alembic environment: the engine is handed in by gpuflex.db.engine.alembic_config."""

from alembic import context

from gpuflex.db.models import Base

config = context.config
engine = config.attributes["engine"]

with engine.begin() as connection:
    context.configure(connection=connection, target_metadata=Base.metadata,
                      render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()
