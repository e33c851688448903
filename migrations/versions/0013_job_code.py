"""jobs.sync, jobs.code_sha256 (issue 33: `submit --sync` sends the code to the hosts)

- jobs.sync: `submit --sync` was given (every host runs the job in its sent copy). False
  for every job before this revision.
- jobs.code_sha256: the content address of the submit directory packed at submit
  (gpuflex/hosts/sync.py); a host that syncs runs the job in
  `<workdir>/.gpuflex/code/<sha256>/`. NULL: nothing packed (every job before).

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-26 17:30:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0013'
down_revision = '0012'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('sync', sa.Boolean(), nullable=False, server_default=sa.false()))
        batch_op.add_column(sa.Column('code_sha256', sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('code_sha256')
        batch_op.drop_column('sync')
