"""Owners' numbers: an agent runs each owner's jobs as its first job uid plus the owner's number
(docs/agent.md, "The job's user"), so two owners' jobs never share a user on a node."""

from collections.abc import Collection

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service.models import Owner


def number_owner(session: Session, name: str) -> int:
    """The owner's number, given at its first job and kept for good. Two service processes
    numbering one new owner at once: the second takes the first's."""
    number = session.scalar(select(Owner.id).where(Owner.name == name))
    if number is not None:
        return number
    try:
        with session.begin_nested():
            owner = Owner(name=name)
            session.add(owner)
        return owner.id
    except IntegrityError:
        return session.scalars(select(Owner.id).where(Owner.name == name)).one()


def owner_numbers(session: Session, names: Collection[str]) -> dict[str, int]:
    """Several owners' numbers in one query, not one per owner (the scheduler's pass asks for all the
    running jobs' owners); one not numbered yet is numbered as number_owner does."""
    numbered = dict(session.execute(select(Owner.name, Owner.id).where(Owner.name.in_(names))).all())
    return {name: numbered[name] if name in numbered else number_owner(session, name) for name in names}
