"""The read side of the job service (gpuflex.control.service.JobService extends it): jobs,
listings, hosts, reports and accounting as plain records (gpuflex.control.views), each
read in a session of its own and shown as the caller may see it (another user's job
without its output: gpuflex.control.access), and the owner checks every command makes
before it writes anything. Nothing here takes the ops lock or changes a row."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator

from sqlalchemy.orm import Session, sessionmaker

from gpuflex.config import Config
from gpuflex.control import access, acct, report, restarts, scaling, views
from gpuflex.control.requests import ArrayRef, parse_ref
from gpuflex.db import queries
from gpuflex.db.models import Job
from gpuflex.errors import UnknownJobError
from gpuflex.states import JobState


class Reads:
    """Reads over `sessions` with `config`'s access rules."""

    def __init__(self, config: Config, sessions: sessionmaker[Session]) -> None:
        self.config = config
        self.sessions = sessions

    def get(self, session: Session, ref: str | int) -> Job:
        """A job by id or name (the newest of that name); UnknownJobError otherwise."""
        key = parse_ref(ref)
        if isinstance(key, ArrayRef):
            job = queries.array_job(session, key.array_id, key.index)
        else:
            job = queries.job(session, key) if isinstance(key, int) else queries.newest_job_named(session, key)
        if job is None:
            raise UnknownJobError(str(ref).strip())
        return job

    def job(self, ref: str | int, *, events: bool = True) -> views.JobInfo:
        """One job with its workers (and its events), as a plain record."""
        with self.sessions() as session:
            return self.as_seen(views.job_info(self.get(session, ref), events=events))

    def as_seen(self, info: views.JobInfo) -> views.JobInfo:
        """`info` as the caller may see it: another user's job without its output."""
        return info if access.may_read(self.config, info.user) else views.without_output(info)

    def check_reader(self, ref: str | int, what: str) -> None:
        """NotReaderError unless the caller may read the job's `what` (logs, events):
        its owner or an admin (gpuflex.control.access.check_reader)."""
        with self.sessions() as session:
            access.check_reader(self.config, self.get(session, ref), what)

    def jobs(self, owner: str | None = None) -> list[views.JobInfo]:
        """Every job with its workers, by id; only `owner`'s when given."""
        return self.listing(owner).jobs

    def listing(self, owner: str | None = None, states: list[JobState] | None = None,
                ended: int | None = None) -> views.Listing:
        """The jobs `status` lists (views.listing): those not ended and the `ended` newest
        ended ones (all when None); only `owner`'s and those in `states` when given."""
        with self.sessions() as session:
            shown = views.listing(session, owner, states, ended)
            return dataclasses.replace(shown, jobs=[self.as_seen(j) for j in shown.jobs])

    def listing_page(self, owner: str | None, states: list[JobState] | None, limit: int,
                     cursor: int | None) -> views.Listing:
        """A page of `status --all`: the `limit` newest jobs below `cursor` (views.listing_page)."""
        with self.sessions() as session:
            shown = views.listing_page(session, owner, states, limit, cursor)
            return dataclasses.replace(shown, jobs=[self.as_seen(j) for j in shown.jobs])

    @contextlib.contextmanager
    def paged(self, owner: str | None, states: list[JobState] | None, limit: int, cursor: int | None):
        """`views.paged` (`status --json`), its jobs read as the caller iterates in this block."""
        with self.sessions() as session:
            page = views.paged(session, owner, states, limit, cursor)
            yield dataclasses.replace(page, jobs=(self.as_seen(j) for j in page.jobs))

    def check_owner_name(self, name: str) -> str:
        """`name` for `status --user` (gpuflex.control.access.check_user): a unix user, or
        the owner of a job here; UsageError otherwise."""
        with self.sessions() as session:
            return access.check_user(name, lambda: queries.owners(session))

    def array_of(self, session: Session, ref: str | int, *, names: bool = False) -> list[Job]:
        """Every job of the array that `ref` stands for as a whole, by index: an array's id
        (its first job's, as Slurm's scancel reads it), and with `names` a name whose newest
        job is one of an array's (`cancel`: the array, not its newest task); [] when `ref`
        stands for one job (`5_3`, another id, a name of a job outside any array)."""
        key = parse_ref(ref)
        if isinstance(key, int):
            return queries.array_jobs(session, key)
        if names and isinstance(key, str):
            newest = queries.newest_job_named(session, key)
            if newest is not None and newest.array_id is not None:
                return queries.array_jobs(session, newest.array_id)
        return []

    def check_may_change(self, ref: str | int, verb: str, *, names: bool = False) -> None:
        """NotOwnerError (gpuflex.control.access) unless the caller owns the job `ref`
        names (every job of an array not ended yet, for an array: see `array_of`) or is an
        admin. An ended job is left to the command, which says it cannot change. Read
        before any command writes: an owner never changes, so no lock is needed."""
        with self.sessions() as session:
            for job in self.array_of(session, ref, names=names) or [self.get(session, ref)]:
                if not job.state.final:
                    access.check_owner(self.config, job, verb)

    def check_scale(self, ref: str | int, n: int) -> None:
        """`check_may_change`, then the refusals of a scale that no refresh can change (a
        fixed gang, `n` outside the job's MIN..MAX), read before the refresh writes its
        probes: a refused scale writes nothing. scale_in_steps checks again, under the lock."""
        self.check_may_change(ref, "scale")
        with self.sessions() as session:
            job = self.get(session, ref)
            if not job.state.final:
                restarts.refuse_fixed_gang(job)
                scaling.check_range(job, n)

    def hosts(self) -> list[dict[str, Any]]:
        """Hosts, their devices, the last probe's figures and who holds each device."""
        with self.sessions() as session:
            return views.pool_view(self.config, session)

    def report(self, since: float) -> dict[str, Any]:
        """`gpuflex report` from `since` until now (gpuflex.control.report)."""
        with self.sessions() as session:
            return report.build(session, since)

    def acct_page(self, f: acct.Filter, limit: int, cursor: int | None) -> tuple[list[dict[str, Any]], int | None]:
        """One page of `gpuflex acct` (gpuflex.control.acct) and the next page's cursor."""
        with self.sessions() as session:
            return acct.page(session, f, limit, cursor)

    def acct_rows(self, f: acct.Filter, cursor: int | None = None, world: bool = True) -> Iterator[dict[str, Any]]:
        """Every row of `gpuflex acct` from `cursor` down, read a page at a time (a session
        held while the caller iterates)."""
        with self.sessions() as session:
            yield from acct.every_row(session, f, cursor, world)
