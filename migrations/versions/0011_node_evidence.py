"""Node evidence: what tells of a node itself (a failing health check, a kernel record, its loss)

Revision ID: 0011_node_evidence
Revises: 0010_notifications
Create Date: 2026-11-28 10:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0011_node_evidence'
down_revision: str | None = '0010_notifications'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        'node_evidence',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('node_id', sa.Integer(), nullable=False),
        sa.Column('kind', sa.String(length=16), nullable=False),
        sa.Column('source', sa.String(length=64), nullable=False),
        sa.Column('detail', sa.String(length=256), nullable=False),
        sa.Column('key', sa.String(length=48), nullable=True),
        sa.Column('job_id', sa.String(length=32), nullable=True),
        sa.Column('attempt', sa.Integer(), nullable=True),
        sa.Column('seen_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('drained', sa.Boolean(), nullable=False),
        sa.ForeignKeyConstraint(['node_id'], ['nodes.id'], name=op.f('fk_node_evidence_node_id_nodes'),
                                ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_node_evidence')),
        sa.UniqueConstraint('node_id', 'key', name=op.f('uq_node_evidence_node_id')),
    )
    op.create_index(op.f('ix_node_evidence_node_id'), 'node_evidence', ['node_id'])
    op.create_index(op.f('ix_node_evidence_seen_at'), 'node_evidence', ['seen_at'])


def downgrade() -> None:
    op.drop_index(op.f('ix_node_evidence_seen_at'), table_name='node_evidence')
    op.drop_index(op.f('ix_node_evidence_node_id'), table_name='node_evidence')
    op.drop_table('node_evidence')
