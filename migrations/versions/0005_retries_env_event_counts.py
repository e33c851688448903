"""jobs.retries, jobs.submit_env, events.count and events.last_time

- jobs.retries: how many times a job may be restarted after a worker crashed (a Python
  exception, a non-zero exit): `submit --retries N`; 0 (fail at the first crash) for
  existing jobs.
- jobs.submit_env: the submitter's environment recorded at submit, which every worker of
  the job gets (newcomers included), never that of whoever runs `scale` or the harvest
  tick; NULL for jobs submitted before (they keep the old behaviour).
- events.count / events.last_time: a repeated event is one row with a count and the time
  of its last repetition, so the database and `status` stay small whatever happens.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23 05:50:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('retries', sa.Integer(), nullable=False, server_default='0'))
        batch_op.add_column(sa.Column('submit_env', sa.JSON(), nullable=True))
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.add_column(sa.Column('count', sa.Integer(), nullable=False, server_default='1'))
        batch_op.add_column(sa.Column('last_time', sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.drop_column('last_time')
        batch_op.drop_column('count')
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('submit_env')
        batch_op.drop_column('retries')
