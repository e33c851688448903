"""events.recorded_at (issue 26: an event's time is when it happened)

- events.recorded_at: when gpuflex wrote the row. `events.time` is now when the thing
  happened: for what a job's coordinator or workers recorded (a generation formed, a
  newcomer left out, a worker's exit, a re-plan), the time their record gives, which a
  later command notices. What a run has recorded already is told by `recorded_at`.
  NULL for every event before this revision: those were recorded at their `time`.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-01 10:00:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.add_column(sa.Column('recorded_at', sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.drop_column('recorded_at')
