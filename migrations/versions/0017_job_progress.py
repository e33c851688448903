"""jobs.progress (issue 28: the step of another user's job, for the admins and the dashboard)

- jobs.progress: the coordinator's progress as the owner's last gpuflex command read it
  ({step, epoch, samples_per_s, world_size, at}: numbers only, `at` when it was read).
  A job's coordinator answers only its owner's commands (its socket directory is
  private), so other users' commands show this instead. NULL: never read (every job
  before this revision).

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-27 20:00:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0017'
down_revision = '0016'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('progress', sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('progress')
