"""jobs.split (issue 12: mixed GPUs)

- jobs.split: how an in-place job's fixed global batch is divided over its workers:
  'speed' (in proportion to each worker's measured speed) or 'even' (`submit --split`).
  NULL: a job submitted before this revision, which ran (and goes on running) even.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-23 12:20:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('split', sa.String(length=8), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('split')
