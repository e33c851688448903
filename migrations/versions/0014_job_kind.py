"""jobs.kind (issue 33: interactive sessions)

- jobs.kind: NULL for a batch job (every job before this revision), "interactive" for
  `gpuflex run` (the command runs in the foreground, on its caller's terminal) and
  "alloc" for `gpuflex alloc` (devices held by a sleeper). Such jobs are never preempted
  or harvested (gpuflex/policy/preemption.py: never_preempted).

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-26 17:30:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0014'
down_revision = '0013'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('kind', sa.String(length=16), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('kind')
