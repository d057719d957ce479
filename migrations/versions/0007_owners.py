"""Owners, numbered once: agents run each owner's jobs as a uid of its own

Revision ID: 0007_owners
Revises: 0006_slurm
Create Date: 2026-11-26 20:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0007_owners'
down_revision: str | None = '0006_slurm'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        'owners',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('name', sa.String(length=128), nullable=False),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_owners')),
        sa.UniqueConstraint('name', name=op.f('uq_owners_name')),
    )
    # The owners of the jobs there are, in the order of their first job.
    op.execute("INSERT INTO owners (name) SELECT owner FROM jobs GROUP BY owner ORDER BY min(submitted_at), owner")


def downgrade() -> None:
    op.drop_table('owners')
