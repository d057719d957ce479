"""Fencing: a node declared lost for an attempt by its peers' evidence, and the share it was fenced from

Revision ID: 0012_fencing
Revises: 0011_node_evidence
Create Date: 2026-11-27 21:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import service.models

revision: str = '0012_fencing'
down_revision: str | None = '0011_node_evidence'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('nodes') as batch:
        batch.add_column(sa.Column('fenced', sa.String(length=512), nullable=True))
    with op.batch_alter_table('attempt_nodes') as batch:
        batch.add_column(sa.Column('fenced_at', service.models.UTCDateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('attempt_nodes') as batch:
        batch.drop_column('fenced_at')
    with op.batch_alter_table('nodes') as batch:
        batch.drop_column('fenced')
