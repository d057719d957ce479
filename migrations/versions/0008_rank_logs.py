"""Rank logs: the last part of each rank's output, shipped by its agent; a failure's diagnosis and
the node whose report told it; a node's health and drain

Revision ID: 0008_rank_logs
Revises: 0007_owners
Create Date: 2026-11-26 21:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0008_rank_logs'
down_revision: str | None = '0007_owners'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        'rank_logs',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('job_id', sa.String(length=32), nullable=False),
        sa.Column('attempt', sa.Integer(), nullable=False),
        sa.Column('rank', sa.Integer(), nullable=False),
        sa.Column('node', sa.String(length=128), nullable=False),
        sa.Column('text', sa.Text(), nullable=False),
        sa.Column('end', sa.BigInteger(), nullable=False),
        sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_rank_logs_job_id_jobs'), ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_rank_logs')),
        sa.UniqueConstraint('job_id', 'attempt', 'rank', name=op.f('uq_rank_logs_job_id')),
    )
    with op.batch_alter_table('attempts') as batch:
        batch.add_column(sa.Column('diagnosis', sa.String(length=32), nullable=True))
        batch.add_column(sa.Column('summary', sa.String(length=256), nullable=True))
        batch.add_column(sa.Column('failed_node_id', sa.Integer(), nullable=True))
        batch.create_foreign_key(op.f('fk_attempts_failed_node_id_nodes'), 'nodes', ['failed_node_id'], ['id'])
    with op.batch_alter_table('nodes') as batch:
        batch.add_column(sa.Column('health', sa.String(length=512), nullable=True))
        batch.add_column(sa.Column('drained', sa.String(length=512), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('nodes') as batch:
        batch.drop_column('drained')
        batch.drop_column('health')
    with op.batch_alter_table('attempts') as batch:
        batch.drop_constraint(op.f('fk_attempts_failed_node_id_nodes'), type_='foreignkey')
        batch.drop_column('failed_node_id')
        batch.drop_column('summary')
        batch.drop_column('diagnosis')
    op.drop_table('rank_logs')
