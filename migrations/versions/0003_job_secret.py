"""jobs.secret: the per-job key that authenticates what a job's members write to its store

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23 03:00:00
"""
import secrets

from alembic import op
import sqlalchemy as sa


revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('secret', sa.String(length=64), nullable=True))
    jobs = sa.table('jobs', sa.column('id', sa.Integer), sa.column('secret', sa.String))
    conn = op.get_bind()
    for (job_id,) in conn.execute(sa.select(jobs.c.id)).all():
        conn.execute(jobs.update().where(jobs.c.id == job_id).values(secret=secrets.token_hex(32)))
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.alter_column('secret', existing_type=sa.String(length=64), nullable=False)


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('secret')
