"""Events: the rollback lookup's index on rank 0's step events only

Revision ID: 0003_rank0_steps
Revises: 0002_ett
Create Date: 2026-11-22 02:55:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0003_rank0_steps'
down_revision: str | None = '0002_ett'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

RANK0_STEPS = sa.text("kind = 'step' AND source = 'rank:0'")


def upgrade() -> None:
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.drop_index('ix_events_job_id_kind_attempt_step')
        batch_op.create_index('ix_events_rank0_steps', ['job_id', 'attempt', 'step'], unique=False,
                              postgresql_where=RANK0_STEPS, sqlite_where=RANK0_STEPS)


def downgrade() -> None:
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.drop_index('ix_events_rank0_steps')
        batch_op.create_index('ix_events_job_id_kind_attempt_step', ['job_id', 'kind', 'attempt', 'step'], unique=False)
