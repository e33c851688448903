"""jobs.socket_dir: the run's control-socket directory, a name nobody else can guess

Before, it was /tmp/gpuflex-<token>, and the token was readable by every user of a
shared database: another user could create that directory first and break the job.
Existing rows keep that path, so jobs running across the upgrade still find their
sockets; each new run of a job gets a fresh random name.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23 03:20:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('socket_dir', sa.String(length=255), nullable=True))
    jobs = sa.table('jobs', sa.column('token', sa.String), sa.column('socket_dir', sa.String))
    op.execute(jobs.update().values(socket_dir=sa.literal('/tmp/gpuflex-') + jobs.c.token))


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('socket_dir')
