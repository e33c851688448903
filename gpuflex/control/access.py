"""Owners and permissions (issue 14): who the caller is, who is an admin, the one check
that every command changing a job goes through, and the one that reading a job's output
or history goes through (issue 30: its owner's and the admins').

A job's owner is the unix user who submitted it (`jobs.user`). Cancelling, scaling,
holding, releasing, updating or requeuing a job is its owner's or an admin's:
`[access] admins` lists user names and `@group` unix groups (membership from the group
database, the primary group included). The caller is the real user of this
process (its uid), never $USER or $LOGNAME, which anyone can set to another name.

Processes belong to a unix account too. A job runs as whoever's gpuflex started it
on each host: the caller on the local host and on an SSH host reached as each user, one
shared account on an SSH host whose `[[hosts]] user` is set. A command can see (exit
records, sockets) and signal only processes of the account it reaches, so it reconciles
only the active jobs whose processes it can reach (`reaches`), and an admin other than
root cannot cancel or scale another user's running job on hosts it reaches as itself:
refused, not recorded as stopped while its processes run on. Root, which reaches every
process, may (`reaches_all`).

The service calls these checks before it writes anything, so a refused command leaves
the database as it was. What they protect against is a mistake between lab members who
share one database, not a member who means harm: whoever can write the database (every
member of the group, for a shared SQLite file) can change its rows directly (see
docs/architecture.md, Security).
"""

from __future__ import annotations

import grp
import os
import pwd
from functools import lru_cache
from typing import Callable, Iterable

from gpuflex.config import Config
from gpuflex.db.models import Job
from gpuflex.errors import UsageError


class NotOwnerError(UsageError):
    """The caller is neither the job's owner nor an admin; nothing was changed."""

    def __init__(self, job_id: int, owner: str, verb: str) -> None:
        super().__init__(f"job {job_id} belongs to {owner}; only {owner} or an admin "
                         f"([access] admins) may {verb} it.")
        self.job_id = job_id
        self.owner = owner
        self.verb = verb


class NotReaderError(UsageError):
    """The caller is neither the job's owner nor an admin: its output and history are not
    theirs to read."""

    def __init__(self, job_id: int, owner: str, what: str) -> None:
        super().__init__(f"job {job_id} belongs to {owner}; only {owner} or an admin "
                         f"([access] admins) may read its {what}.")


def caller() -> str:
    """The real user of this process by name (its uid as digits when it has no name)."""
    uid = os.getuid()
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


@lru_cache(maxsize=256)
def user_groups(user: str) -> frozenset[str]:
    """The unix groups `user` is in, primary and supplementary; none for an unknown user."""
    try:
        pw = pwd.getpwnam(user)
        gids = os.getgrouplist(user, pw.pw_gid)
    except (KeyError, OSError):
        return frozenset()
    names = set()
    for gid in gids:
        try:
            names.add(grp.getgrgid(gid).gr_name)
        except KeyError:
            continue
    return frozenset(names)


def is_admin(config: Config, user: str) -> bool:
    """Whether `[access] admins` names `user` or a `@group` they are in."""
    admins = config.access.admins
    if user in admins:
        return True
    groups = {a[1:] for a in admins if a.startswith("@")}
    return bool(groups) and not groups.isdisjoint(user_groups(user))


def may_change(config: Config, owner: str, who: str) -> bool:
    """Whether `who` may change a job that `owner` submitted."""
    return who == owner or is_admin(config, who)


def check_owner(config: Config, job: Job, verb: str) -> None:
    """NotOwnerError (exit 2) unless the caller owns `job` or is an admin; `verb` is what
    was refused ("cancel", "scale"). UsageError when an admin's command could not reach
    the processes of another user's running job."""
    if not may_change(config, job.user, caller()):
        raise NotOwnerError(job.id, job.user, verb)
    if not reaches(config, job) and not reaches_all():
        hosts = ", ".join(sorted(process_hosts(job)))
        raise UsageError(f"job {job.id} runs as {job.user} on {hosts}, which gpuflex reaches as each user: "
                         f"only {job.user}'s own gpuflex can {verb} it (or reach the hosts through one "
                         f"shared account: [[hosts]] user).")


def check_reader(config: Config, job: Job, what: str) -> None:
    """NotReaderError (exit 2) unless the caller owns `job` or is an admin: a job's output
    (`logs`, `fetch`), its history (`events`) and its crash's traceback are its owner's;
    the queue (`status`) shows every job without them."""
    if not may_change(config, job.user, caller()):
        raise NotReaderError(job.id, job.user, what)


def may_read(config: Config, owner: str) -> bool:
    """Whether the caller may read the output and history of a job `owner` submitted."""
    return may_change(config, owner, caller())


def changed_by(job: Job) -> str:
    """Who changes `job`, as its history names them (after `check_owner` let them): the
    caller, "bob", and for another user's job, which only an admin may change, "carol
    (admin)"."""
    who = caller()
    return who if who == job.user else f"{who} (admin)"


def process_hosts(job: Job) -> set[str]:
    """The hosts where `job` has processes now: its live workers' and its coordinator's."""
    return {w.host for w in job.live_workers} | ({job.store_host} if job.store_pgid and job.store_host else set())


def shared_account(config: Config, host_name: str) -> bool:
    """Whether every user's gpuflex reaches the host as one account: an SSH host with
    `[[hosts]] user` set. (The local host, and an SSH host reached as each user, run a
    job as whoever started it.)"""
    host = next((h for h in config.hosts if h.name == host_name), None)
    return host is not None and not host.is_local and host.user is not None


def reaches(config: Config, job: Job) -> bool:
    """Whether this caller's commands can see and signal `job`'s processes: its own job,
    or one whose processes all run on shared-account hosts."""
    return job.user == caller() or all(shared_account(config, h) for h in process_hosts(job))


def reaches_all() -> bool:
    """Whether this process can signal and read every user's processes and files here:
    root (uid 0). Root listed as an admin may so change another user's running job on the
    local host too (issue 33), as Slurm's operators scancel any job; on an SSH host reached
    as each user, root's gpuflex logs in as root. A non-root admin is given a way in
    docs/security.md (a sudo rule running gpuflex as the job's owner), never a path
    here around the kernel's own check. Starting a job stays the owner's (`may_start`):
    its processes must run as its owner, never as root. Asked of `caller()`, the one
    function that says who runs the command."""
    who = caller()
    try:
        return pwd.getpwnam(who).pw_uid == 0
    except (KeyError, ValueError):
        return who == "0"


def may_start(config: Config, job: Job, hosts: Iterable[str] | None = None) -> bool:
    """Whether this caller's command may start `job`'s processes on `hosts` (None: on any
    configured host): they run as whoever starts them on the local host and on SSH hosts
    reached as each user, so only the owner's own command starts a job there; on
    shared-account hosts anyone's may."""
    names = [h.name for h in config.hosts] if hosts is None else list(hosts)
    return job.user == caller() or all(shared_account(config, h) for h in names)


def check_user(name: str, owners: Callable[[], Iterable[str]]) -> str:
    """`name` for `status --user` if it is a unix user (who may have no job yet) or owns a
    job here (`owners()`, asked only then: a user since removed); UsageError otherwise."""
    try:
        pwd.getpwnam(name)
        return name
    except (KeyError, ValueError):   # ValueError: a NUL in the name
        pass
    if name in set(owners()):
        return name
    raise UsageError(f"--user {name!r}: there is no unix user of that name and no job of theirs; "
                     f"run 'gpuflex status' to see the owners.")
