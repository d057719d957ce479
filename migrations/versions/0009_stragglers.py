"""Stragglers: the ranks an attempt's step timings found its peers waiting for

Revision ID: 0009_stragglers
Revises: 0008_rank_logs
Create Date: 2026-11-26 23:50:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0009_stragglers'
down_revision: str | None = '0008_rank_logs'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        'stragglers',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('job_id', sa.String(length=32), nullable=False),
        sa.Column('attempt', sa.Integer(), nullable=False),
        sa.Column('rank', sa.Integer(), nullable=False),
        sa.Column('node', sa.String(length=128), nullable=False),
        sa.Column('since_step', sa.Integer(), nullable=False),
        sa.Column('flagged_step', sa.Integer(), nullable=False),
        sa.Column('relative', sa.Double(), nullable=False),
        sa.Column('individual', sa.Double(), nullable=True),
        sa.Column('work_seconds', sa.Double(), nullable=False),
        sa.Column('peer_seconds', sa.Double(), nullable=False),
        sa.Column('action', sa.String(length=16), nullable=False),
        sa.Column('flagged_at', sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_stragglers_job_id_jobs'), ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_stragglers')),
        sa.UniqueConstraint('job_id', 'attempt', 'rank', name=op.f('uq_stragglers_job_id')),
    )
    op.create_index(op.f('ix_stragglers_node'), 'stragglers', ['node'])
    op.create_index(op.f('ix_stragglers_flagged_at'), 'stragglers', ['flagged_at'])
    timings = sa.text("kind = 'step_timing'")
    op.create_index('ix_events_step_timings', 'events', ['job_id', 'attempt', 'step'], postgresql_where=timings,
                    sqlite_where=timings)


def downgrade() -> None:
    op.drop_index('ix_events_step_timings', table_name='events')
    op.drop_index(op.f('ix_stragglers_flagged_at'), table_name='stragglers')
    op.drop_index(op.f('ix_stragglers_node'), table_name='stragglers')
    op.drop_table('stragglers')
