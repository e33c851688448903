"""jobs.image (issue 33: `submit --image` runs each worker in a container)

- jobs.image: the container image each worker runs in, through its host's engine
  (`[[hosts]] container`: gpuflex/hosts/container.py). NULL: on the host itself (every
  job before this revision).

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-26 19:00:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0016'
down_revision = '0015'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('image', sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('image')
