"""Attempts: the checkpoint interval last given to their ranks

Revision ID: 0005_attempt_interval
Revises: 0004_token_expiry
Create Date: 2026-11-25 05:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0005_attempt_interval'
down_revision: str | None = '0004_token_expiry'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('attempts', schema=None) as batch_op:
        batch_op.add_column(sa.Column('interval_steps', sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('attempts', schema=None) as batch_op:
        batch_op.drop_column('interval_steps')
