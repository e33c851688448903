"""jobs.held, jobs.dependency (issue 33: hold/release, Slurm's dependency kinds)

- jobs.held: a queued job the scheduler never starts until `gpuflex release` (`gpuflex
  hold`). False for every job before this revision.
- jobs.dependency: the `--after` kinds beyond afterok, as {"afterany": [ids],
  "afternotok": [ids], "singleton": true} (only the kinds given). afterok ids stay in
  jobs.after, as before. NULL: none (every job before this revision).

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-26 16:00:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0012'
down_revision = '0011'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('held', sa.Boolean(), nullable=False, server_default=sa.false()))
        batch_op.add_column(sa.Column('dependency', sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('dependency')
        batch_op.drop_column('held')
