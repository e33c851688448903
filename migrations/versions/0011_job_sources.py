"""jobs.sources (issue 33: job scripts and task files)

- jobs.sources: where each of submit's settings came from, as JSON
  {setting: "command line" | "#GPUFLEX" | "#SBATCH" | "task file" | "default"}
  (gpuflex/cli/job_settings.py); `status JOB` shows it. NULL for every job before this
  revision, and for one recorded without the CLI.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-02 10:00:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('sources', sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('sources')
