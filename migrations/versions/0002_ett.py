"""ETT: events, checkpoints catalog, per-job accounting

Revision ID: 0002_ett
Revises: 0001
Create Date: 2026-11-21 16:43:49.178681
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0002_ett'
down_revision: str | None = '0001'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('checkpoints',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('job_id', sa.String(length=32), nullable=False),
    sa.Column('attempt', sa.Integer(), nullable=False),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('started_at', sa.Double(), nullable=True),
    sa.Column('staged_at', sa.Double(), nullable=True),
    sa.Column('committed_at', sa.Double(), nullable=True),
    sa.Column('failed_at', sa.Double(), nullable=True),
    sa.Column('path', sa.String(length=1024), nullable=True),
    sa.Column('bytes', sa.BigInteger(), nullable=True),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_checkpoints_job_id_jobs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_checkpoints')),
    sa.UniqueConstraint('job_id', 'attempt', 'step', name=op.f('uq_checkpoints_job_id'))
    )
    op.create_table('ett_accounts',
    sa.Column('job_id', sa.String(length=32), nullable=False),
    sa.Column('account', sa.JSON(), nullable=False),
    sa.Column('window_start', sa.Double(), nullable=True),
    sa.Column('finished_at', sa.Double(), nullable=True),
    sa.Column('last_event_at', sa.Double(), nullable=True),
    sa.Column('failures', sa.Integer(), nullable=False),
    sa.Column('events', sa.BigInteger(), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_ett_accounts_job_id_jobs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('job_id', name=op.f('pk_ett_accounts'))
    )
    op.create_table('events',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('job_id', sa.String(length=32), nullable=False),
    sa.Column('attempt', sa.Integer(), nullable=False),
    sa.Column('source', sa.String(length=160), nullable=False),
    sa.Column('seq', sa.BigInteger(), nullable=False),
    sa.Column('kind', sa.String(length=32), nullable=False),
    sa.Column('ts', sa.Double(), nullable=False),
    sa.Column('clock_offset_seconds', sa.Double(), nullable=False),
    sa.Column('step', sa.Integer(), nullable=True),
    sa.Column('duration', sa.Double(), nullable=True),
    sa.Column('data', sa.JSON(), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_events_job_id_jobs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_events')),
    sa.UniqueConstraint('job_id', 'attempt', 'source', 'seq', name=op.f('uq_events_job_id'))
    )
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.create_index('ix_events_job_id_kind_attempt_step', ['job_id', 'kind', 'attempt', 'step'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.drop_index('ix_events_job_id_kind_attempt_step')

    op.drop_table('events')
    op.drop_table('ett_accounts')
    op.drop_table('checkpoints')
