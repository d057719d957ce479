"""Tokens: an optional expiry

Revision ID: 0004_token_expiry
Revises: 0003_rank0_steps
Create Date: 2026-11-25 04:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import service.models

revision: str = '0004_token_expiry'
down_revision: str | None = '0003_rank0_steps'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('tokens', schema=None) as batch_op:
        batch_op.add_column(sa.Column('expires_at', service.models.UTCDateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('tokens', schema=None) as batch_op:
        batch_op.drop_column('expires_at')
