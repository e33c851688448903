"""jobs.elastic, jobs.time_limit_s, jobs.after, jobs.array_id/array_index/array_limit,
jobs.requeue (issue 11: every job a lab has)

- jobs.elastic: how a job changes size: 'inplace' (gpuflex.elastic resizes the running
  processes; the default for MIN < MAX), 'restart' (the whole gang is stopped and
  relaunched at the new size; the script resumes from its own checkpoint), NULL (a fixed
  gang: torchrun's contract, no resize). Existing jobs: 'inplace' (what they ran as).
- jobs.time_limit_s: the wall-clock limit of a run (`--time`); NULL: none. At the limit the
  job ends in the new final state 'timeout' (a VARCHAR value: no schema change for it).
- jobs.after: ids of jobs that must succeed first (`--after`); NULL: none.
- jobs.array_id / array_index / array_limit: the job's array (the id of its first job),
  its index (GPUFLEX_ARRAY_INDEX) and the array's cap on running jobs (`%N`); NULL outside
  an array.
- jobs.requeue: the job may be preempted (stopped and requeued) by a higher-priority one.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-23 09:00:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('elastic', sa.String(length=16), nullable=True))
        batch_op.add_column(sa.Column('time_limit_s', sa.Float(), nullable=True))
        batch_op.add_column(sa.Column('after', sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column('array_id', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('array_index', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('array_limit', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('requeue', sa.Boolean(), nullable=False, server_default=sa.false()))
        batch_op.create_index('ix_jobs_array_id', ['array_id'])
    op.execute("UPDATE jobs SET elastic = 'inplace'")


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_index('ix_jobs_array_id')
        for name in ('requeue', 'array_limit', 'array_index', 'array_id', 'after', 'time_limit_s', 'elastic'):
            batch_op.drop_column(name)
