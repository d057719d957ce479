"""A spare held for a straggler's replacement: the job it is reserved for (its state `reserved`)

Revision ID: 0017_spare_reservations
Revises: 0016_elastic
Create Date: 2026-11-28 15:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0017_spare_reservations'
down_revision: str | None = '0016_elastic'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('nodes') as batch:
        batch.add_column(sa.Column('reserved_for', sa.String(length=32), nullable=True))
        batch.create_foreign_key(batch.f('fk_nodes_reserved_for_jobs'), 'jobs', ['reserved_for'], ['id'],
                                 ondelete='SET NULL')


def downgrade() -> None:
    with op.batch_alter_table('nodes') as batch:
        batch.drop_constraint(batch.f('fk_nodes_reserved_for_jobs'), type_='foreignkey')
        batch.drop_column('reserved_for')
