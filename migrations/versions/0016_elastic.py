"""Elastic jobs: an attempt's full size where it runs on fewer nodes, the size it was weighed growing
back to, and the index of the sizes a job's run declared (its `elastic` events)

Revision ID: 0016_elastic
Revises: 0015_straggler_reasons
Create Date: 2026-11-28 14:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0016_elastic'
down_revision: str | None = '0015_straggler_reasons'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('attempts') as batch:
        batch.add_column(sa.Column('full_nodes', sa.Integer(), nullable=True))
        batch.add_column(sa.Column('grow_weighed', sa.Integer(), nullable=True))
    elastic = sa.text("kind = 'elastic'")
    op.create_index('ix_events_elastic', 'events', ['job_id'], postgresql_where=elastic, sqlite_where=elastic)


def downgrade() -> None:
    op.drop_index('ix_events_elastic', table_name='events')
    with op.batch_alter_table('attempts') as batch:
        batch.drop_column('grow_weighed')
        batch.drop_column('full_nodes')
