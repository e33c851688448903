"""The database's side of the job listings: `status`'s (the jobs not ended and the newest
ended ones), and the keyset pages of `status --all`, `status --json` and `acct`. Part of
the one door to the database (gpuflex.db.queries), in a module of its own: the same
contract, each function given the caller's session.

A page is the jobs below the last id the previous one showed, so a job recorded meanwhile
shifts no page, and the database stops at the page's size.
"""

from __future__ import annotations

from typing import Iterable

from sqlalchemy import func, select
from sqlalchemy.orm import Session, load_only, selectinload

from gpuflex.db.models import Job
from gpuflex.db.queries import FINAL, NOT_FINAL
from gpuflex.states import JobState


def page_where(users: Iterable[str] | None = None, states: Iterable[JobState] | None = None,
               since: float | None = None, until: float | None = None, name: str | None = None) -> list:
    """The WHERE clauses of a page of jobs (acct's, status's): of `users`, in `states`, ended
    in [since, until], named `name`; each left out when None."""
    where = [] if users is None else [Job.user.in_(list(users))]
    where += [] if states is None else [Job.state.in_(list(states))]
    where += [] if since is None else [Job.ended_at >= since]
    where += [] if until is None else [Job.ended_at <= until]
    return where + ([] if name is None else [Job.name == name])


def listed_jobs(session: Session, *, owner: str | None = None, states: Iterable[JobState] | None = None,
                ended: int | None = None) -> list[Job]:
    """Jobs by id, their workers loaded with them (a few queries, whatever their number):
    every job not ended, and of the ended ones the `ended` newest by end time (all when
    None); only `owner`'s and only those in `states` when given. The database filters."""
    where = page_where(None if owner is None else [owner], states)
    q = select(Job).where(*where).options(selectinload(Job.workers)).order_by(Job.id)
    if ended is not None:
        newest = select(Job.id).where(*where, Job.state.in_(FINAL)).order_by(
            func.coalesce(Job.ended_at, Job.created_at).desc(), Job.id.desc()).limit(ended)
        q = q.where(Job.state.in_(NOT_FINAL) | Job.id.in_(newest))
    return list(session.scalars(q))


def ended_count(session: Session, *, owner: str | None = None, states: Iterable[JobState] | None = None) -> int:
    """How many ended jobs a listing with the same filters holds (counted by the database)."""
    return jobs_count(session, [*page_where(None if owner is None else [owner], states), Job.state.in_(FINAL)])


def ended_jobs_page(session: Session, *, users: Iterable[str] | None = None, since: float | None = None,
                    until: float | None = None, states: Iterable[JobState] | None = None,
                    name: str | None = None, below: int | None = None, limit: int = 100,
                    columns: tuple = ()) -> list[Job]:
    """Up to `limit` ended jobs, newest id first and below `below` when given, that ended in
    [since, until], of `users`, in `states` (final ones), named `name` (acct's page);
    `columns`: only those loaded (jobs_page)."""
    return jobs_page(session, page_where(users, list(states) if states else list(FINAL), since, until, name),
                     below=below, limit=limit, columns=columns)


def jobs_page(session: Session, where: list, *, below: int | None = None, above: int | None = None,
              limit: int = 100, oldest_first: bool = False, workers: bool = False,
              columns: tuple = ()) -> list[Job]:
    """Up to `limit` jobs matching `where` (`page_where`) with ids in (above, below), newest
    first (or oldest), with their workers loaded when asked (one more query). The keyset of
    every paged listing: a page is the jobs below the last id the previous one showed, so
    a job recorded meanwhile shifts no page, and the database stops at `limit` rows.
    `columns` (Job attributes): only those loaded, the rest on first use (a reader of a few
    fields of many jobs skips the JSON columns' decoding)."""
    q = select(Job).where(*where, *_between(above, below))
    q = q.options(load_only(*columns)) if columns else q
    q = q.options(selectinload(Job.workers)) if workers else q
    return list(session.scalars(q.order_by(Job.id if oldest_first else Job.id.desc()).limit(limit)))


def job_ids_page(session: Session, where: list, *, below: int | None = None, limit: int = 100) -> list[int]:
    """The ids `jobs_page` would return, newest first (ids alone: a page's bounds)."""
    return list(session.scalars(select(Job.id).where(*where, *_between(None, below))
                                .order_by(Job.id.desc()).limit(limit)))


def jobs_count(session: Session, where: list, *, below: int | None = None) -> int:
    """How many jobs matching `where` have ids below `below` (counted by the database)."""
    return session.scalar(select(func.count(Job.id)).where(*where, *_between(None, below))) or 0


def _between(above: int | None, below: int | None) -> list:
    return ([] if above is None else [Job.id > above]) + ([] if below is None else [Job.id < below])
