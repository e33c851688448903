"""Quotas and fair share read from the database (issue 14): who is an admin, each user's
limit and the devices they hold, their decayed usage. The rules are
gpuflex.policy.fairshare's (pure); this module gives them the facts: the workers table,
the config, and the unix user and group database for `@group` entries.

Below gpuflex.control.queueing (placing order, the quota gate), gpuflex.control.scaling
(`scale` refuses a grow over quota) and gpuflex.control.harvest_inputs (the harvest plan
grows within quotas, least-used user first).

Who is an admin, and a user's groups, are gpuflex.control.access's (the same lookup as
owners and permissions).
"""

from __future__ import annotations

import time

from gpuflex.config import Config
from gpuflex.control.access import is_admin, user_groups
from gpuflex.control.executor import Ops
from gpuflex.db import queries
from gpuflex.db.models import Job
from gpuflex.errors import UsageError
from gpuflex.policy import fairshare


def quota(config: Config, user: str, held: int) -> fairshare.Quota:
    """The user's quota (gpuflex.policy.fairshare.limit_for) with the devices they hold."""
    q = config.quota
    needs_groups = any(k.startswith("@") for k in q.users)
    limit = fairshare.limit_for(q, user, user_groups(user) if needs_groups else (),
                                admin=q.admins_exempt and is_admin(config, user))
    return fairshare.Quota(user, limit, held)


def quota_of(ops: Ops, user: str) -> fairshare.Quota:
    """The user's quota as the database stands in this transaction."""
    if ops.config.quota.default_gpus is None and not ops.config.quota.users:
        return fairshare.Quota(user, None, 0)
    return quota(ops.config, user, queries.held_by_user(ops.session).get(user, 0))


def usage(ops: Ops, now: float | None = None) -> dict[str, float]:
    """Decayed GPU-hours per user (gpuflex.policy.fairshare.usage), from the workers table:
    each worker's interval times its job's GPUs per worker (a CPU slot counts as one)."""
    now = time.time() if now is None else now
    half_life = ops.config.quota.half_life_h
    holds = queries.usage_since(ops.session, fairshare.forget_before(now, half_life))
    return fairshare.usage((fairshare.Hold(u, s, e, max(per, 1)) for u, s, e, per in holds), now, half_life)


def refuse_over_quota(ops: Ops, job: Job, workers: int) -> None:
    """UsageError when `workers` more workers of the job would take its owner past their
    quota (a scale; nothing has changed yet)."""
    refusal = quota_of(ops, job.user).refusal(workers, job.gpus_per_worker)
    if refusal is not None:
        raise UsageError(f"job {job.id}: cannot grow by {workers}: {refusal}.")
