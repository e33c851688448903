"""workers.retired_at (issue 28: a leaver's exit 0 is its leaving, not the end of the training)

- workers.retired_at: when a shrink asked the worker to leave at its next step boundary.
  A job whose kept workers are lost right after a shrink (a host rebooted) is judged by
  the generation the database knew, which still names the leavers: one that had already
  exited 0 had left, it had not finished the training, so the job is requeued for the
  fault instead of failed. NULL: never asked (every worker before this revision).

Revision ID: 0018
Revises: 0017
Create Date: 2026-11-28 03:00:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0018'
down_revision = '0017'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('workers', schema=None) as batch_op:
        batch_op.add_column(sa.Column('retired_at', sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('workers', schema=None) as batch_op:
        batch_op.drop_column('retired_at')
