"""jobs.resume_from (issue 13: a checkpoint resumed at any world size)

- jobs.resume_from: the checkpoint directory of an earlier job that an in-place job's
  workers start from (`submit --resume-from PATH`, absolute and normalised; the workers get
  it as GPUFLEX_RESUME_FROM). NULL: the job starts afresh (every job before this revision).

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-24 10:00:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('resume_from', sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('resume_from')
