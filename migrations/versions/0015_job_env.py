"""jobs.python, jobs.venv, jobs.conda, jobs.env_setup (issue 33: per-job environments)

- jobs.python: `submit --python PATH` (a command starting with python or python3 runs it).
- jobs.venv: `submit --venv PATH` (the workers run with PATH/bin first on PATH).
- jobs.conda: `submit --conda NAME` (the command runs through `conda run -n NAME`).
- jobs.env_setup: `submit --env-setup CMD` (run once per host per run, before the workers).

NULL: not given (every job before this revision). See gpuflex/jobenv.py.

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-26 19:00:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0015'
down_revision = '0014'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('python', sa.Text(), nullable=True))
        batch_op.add_column(sa.Column('venv', sa.Text(), nullable=True))
        batch_op.add_column(sa.Column('conda', sa.String(length=128), nullable=True))
        batch_op.add_column(sa.Column('env_setup', sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('env_setup')
        batch_op.drop_column('conda')
        batch_op.drop_column('venv')
        batch_op.drop_column('python')
