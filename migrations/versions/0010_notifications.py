"""Notifications: the deliveries a job's events owe its webhooks

Revision ID: 0010_notifications
Revises: 0009_stragglers
Create Date: 2026-11-27 02:40:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0010_notifications'
down_revision: str | None = '0009_stragglers'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        'notifications',
        sa.Column('id', sa.String(length=32), nullable=False),
        sa.Column('job_id', sa.String(length=32), nullable=False),
        sa.Column('key', sa.String(length=64), nullable=False),
        sa.Column('event', sa.String(length=16), nullable=False),
        sa.Column('webhook', sa.Integer(), nullable=False),
        sa.Column('url', sa.String(length=2048), nullable=False),
        sa.Column('body', sa.Text(), nullable=False),
        sa.Column('state', sa.String(length=16), nullable=False),
        sa.Column('tries', sa.Integer(), nullable=False),
        sa.Column('next_try_at', sa.Double(), nullable=False),
        sa.Column('last_error', sa.String(length=512), nullable=True),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('delivered_at', sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_notifications_job_id_jobs'), ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_notifications')),
        sa.UniqueConstraint('job_id', 'key', 'webhook', name=op.f('uq_notifications_job_id')),
    )
    op.create_index('ix_notifications_due', 'notifications', ['state', 'next_try_at'])


def downgrade() -> None:
    op.drop_index('ix_notifications_due', table_name='notifications')
    op.drop_table('notifications')
