"""A straggler flag's reason (why `replace` kept the attempt where it ran) and whether it followed the rank

Revision ID: 0015_straggler_reasons
Revises: 0014_learned_imports
Create Date: 2026-11-28 12:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0015_straggler_reasons'
down_revision: str | None = '0014_learned_imports'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('stragglers') as batch:
        batch.add_column(sa.Column('reason', sa.String(length=512), nullable=True))
        batch.add_column(sa.Column('follows_rank', sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table('stragglers') as batch:
        batch.drop_column('follows_rank')
        batch.drop_column('reason')
