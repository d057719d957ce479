"""Slurm: allocations, job-bound agent tokens and nodes, the leaving node state

Revision ID: 0006_slurm
Revises: 0005_attempt_interval
Create Date: 2026-11-25 07:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0006_slurm'
down_revision: str | None = '0005_attempt_interval'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SLURM_STATES = ('submitted', 'running', 'ended')


def upgrade() -> None:
    op.create_table(
        'slurm_allocations',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('job_id', sa.String(length=32), nullable=False),
        sa.Column('number', sa.Integer(), nullable=False),
        sa.Column('slurm_job_id', sa.String(length=32), nullable=False),
        sa.Column('state', sa.Enum(*SLURM_STATES, name='slurmstate', native_enum=False, length=16), nullable=False),
        sa.Column('slurm_state', sa.String(length=32), nullable=False),
        sa.Column('slurm_reason', sa.String(length=256), nullable=True),
        sa.Column('slurm_nodes', sa.JSON(), nullable=False),
        sa.Column('bad_nodes', sa.JSON(), nullable=False),
        sa.Column('token_id', sa.Integer(), nullable=False),
        sa.Column('submitted_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('started_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('ended_at', sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_slurm_allocations_job_id_jobs'),
                                ondelete='CASCADE'),
        sa.ForeignKeyConstraint(['token_id'], ['tokens.id'], name=op.f('fk_slurm_allocations_token_id_tokens')),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_slurm_allocations')),
        sa.UniqueConstraint('job_id', 'number', name=op.f('uq_slurm_allocations_job_id')),
    )
    op.create_index(op.f('ix_slurm_allocations_job_id'), 'slurm_allocations', ['job_id'], unique=False)
    op.create_index(op.f('ix_slurm_allocations_state'), 'slurm_allocations', ['state'], unique=False)
    with op.batch_alter_table('tokens', schema=None) as batch_op:
        batch_op.add_column(sa.Column('job_id', sa.String(length=32), nullable=True))
        batch_op.create_foreign_key(batch_op.f('fk_tokens_job_id_jobs'), 'jobs', ['job_id'], ['id'], ondelete='CASCADE')
    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.add_column(sa.Column('job_id', sa.String(length=32), nullable=True))
        batch_op.create_foreign_key(batch_op.f('fk_nodes_job_id_jobs'), 'jobs', ['job_id'], ['id'], ondelete='CASCADE')
        batch_op.create_index(batch_op.f('ix_nodes_job_id'), ['job_id'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_nodes_job_id'))
        batch_op.drop_constraint(batch_op.f('fk_nodes_job_id_jobs'), type_='foreignkey')
        batch_op.drop_column('job_id')
    with op.batch_alter_table('tokens', schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f('fk_tokens_job_id_jobs'), type_='foreignkey')
        batch_op.drop_column('job_id')
    op.drop_index(op.f('ix_slurm_allocations_state'), table_name='slurm_allocations')
    op.drop_index(op.f('ix_slurm_allocations_job_id'), table_name='slurm_allocations')
    op.drop_table('slurm_allocations')
