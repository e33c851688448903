"""jobs.notify_url (issue 14 item 5: notifications)

- jobs.notify_url: the webhook posted (JSON) when the job ends, fails, is preempted or
  times out: `submit --notify URL`, else `[notify] url` when the job was submitted. NULL:
  none (every job submitted before this revision).

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-23 09:20:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('notify_url', sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('notify_url')
