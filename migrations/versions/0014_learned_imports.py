"""A job's learned imports: what its script's first attempt imported, its next launches' warm imports

Revision ID: 0014_learned_imports
Revises: 0012_fencing
Create Date: 2026-11-28 10:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0014_learned_imports'
down_revision: str | None = '0012_fencing'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.add_column(sa.Column('learned_imports', sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.drop_column('learned_imports')
