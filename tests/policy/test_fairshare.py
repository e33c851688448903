"""Fair share and quotas (issue 14) as tables: limits, overrides, admins, the decay's
arithmetic, the placing order and ties; the harvest plan within quotas and by usage; a
finished job is never grown. Pure, no I/O."""

from __future__ import annotations

import math

import pytest

from gpuflex.config import HarvestSettings, QuotaSettings
from gpuflex.elastic.protocol.wire import parse_status
from gpuflex.policy import fairshare as F
from gpuflex.policy.harvest import GpuView, Grow, JobView, Place, Share, WorkerView, plan, training_finished

H = 3600.0
NOW = 1_000_000.0


# ---- limits ---------------------------------------------------------------------------
LIMITS = {
    "no [quota] at all: no limit": (QuotaSettings(), "alice", (), False, None),
    "the default": (QuotaSettings(default_gpus=8), "alice", (), False, 8),
    "a user's own override wins over the default": (QuotaSettings(default_gpus=8, users={"alice": 2}),
                                                    "alice", (), False, 2),
    "an override may be above the default": (QuotaSettings(default_gpus=2, users={"alice": 16}),
                                             "alice", (), False, 16),
    "another user's override does not apply": (QuotaSettings(default_gpus=8, users={"bob": 2}),
                                               "alice", (), False, 8),
    "a group's override applies to its members": (QuotaSettings(default_gpus=8, users={"@students": 4}),
                                                  "alice", ("students",), False, 4),
    "the smallest of several groups": (QuotaSettings(users={"@a": 4, "@b": 2}), "alice", ("a", "b"), False, 2),
    "the user's own override wins over a group's": (QuotaSettings(users={"@students": 4, "alice": 6}),
                                                    "alice", ("students",), False, 6),
    "an exempt admin has no limit": (QuotaSettings(default_gpus=8, users={"root": 1}), "root", (), True, None),
    "an admin who is not exempt has the usual one": (QuotaSettings(default_gpus=8, admins_exempt=False),
                                                     "root", (), True, 8),
    "zero: nothing at all": (QuotaSettings(default_gpus=0), "alice", (), False, 0),
}


@pytest.mark.parametrize("case", LIMITS)
def test_limit_for(case):
    settings, user, groups, admin, want = LIMITS[case]
    assert F.limit_for(settings, user, groups, admin) == want


QUOTAS = {
    # limit, held, workers, per worker -> refusal (None: fits), workers still allowed
    "fits exactly": (8, 4, 2, 2, None, 2),
    "one GPU over": (8, 6, 1, 4, "alice holds 6 of their 8 GPUs ([quota]); this job needs 4", 0),
    "already over (limit lowered)": (2, 4, 1, 1, "alice holds 4 of their 2 GPUs ([quota]); this job needs 1", 0),
    "no limit": (None, 100, 50, 8, None, None),
    "CPU slots count one per worker at least": (3, 2, 2, 0, "alice holds 2 of their 3 GPUs ([quota]); this job needs 2",
                                               1),
}


@pytest.mark.parametrize("case", QUOTAS)
def test_quota_refusal_and_room(case):
    limit, held, workers, per, refusal, allowed = QUOTAS[case]
    q = F.Quota("alice", limit, held)
    assert q.refusal(workers, per) == refusal
    assert q.workers_allowed(per) == allowed


# ---- the decay ------------------------------------------------------------------------
DECAY = {
    # start, end (None: still held), half-life h -> decayed hours
    "held for an instant: nothing": (NOW, NOW, 24, 0.0),
    "an hour that just ended, long half-life: ~one hour": (NOW - H, NOW, 1e6, 1.0),
    "one second around one half-life ago weighs a half": (NOW - 24 * H - 0.5, NOW - 24 * H + 0.5, 24, 0.5 / H),
    "held for ever: the integral's limit is H / ln 2": (-1e12, None, 1, 1 / math.log(2)),
    "one half-life, ending now: H/ln2 x (1 - 1/2)": (NOW - 2 * H, None, 2, 2 / math.log(2) * 0.5),
    "that same stretch one half-life earlier weighs half": (NOW - 4 * H, NOW - 2 * H, 2, 2 / math.log(2) * 0.25),
    "an end in the future counts only up to now": (NOW - 2 * H, NOW + 5 * H, 2, 2 / math.log(2) * 0.5),
    "starting in the future: nothing": (NOW + 1, None, 2, 0.0),
}


@pytest.mark.parametrize("case", DECAY)
def test_decayed_hours(case):
    start, end, half_life, want = DECAY[case]
    assert F.decayed_hours(start, end, NOW, half_life) == pytest.approx(want, rel=1e-6, abs=1e-12)


def test_decay_splits_additively_so_the_figure_does_not_depend_on_how_often_it_is_taken():
    whole = F.decayed_hours(NOW - 10 * H, NOW - H, NOW, 3)
    parts = sum(F.decayed_hours(NOW - (10 - i) * H, NOW - (9 - i) * H, NOW, 3) for i in range(9))
    assert parts == pytest.approx(whole, rel=1e-12)


def test_usage_sums_devices_times_decayed_hours_per_user():
    holds = [F.Hold("alice", NOW - 2 * H, None, 4), F.Hold("alice", NOW - 4 * H, NOW - 2 * H, 2),
             F.Hold("bob", NOW - 2 * H, None, 1)]
    got = F.usage(holds, NOW, 2)
    unit = 2 / math.log(2)
    assert got == pytest.approx({"alice": 4 * unit * 0.5 + 2 * unit * 0.25, "bob": unit * 0.5})


def test_a_bad_half_life_is_refused():
    with pytest.raises(ValueError, match="half_life_h"):
        F.decayed_hours(0, 1, 2, 0)


def test_forget_before_leaves_out_only_what_weighs_nothing():
    cut = F.forget_before(NOW, 24)
    assert F.decayed_hours(cut - 100 * H, cut, NOW, 24) < 1e-6


# ---- the placing order ------------------------------------------------------------------
ORDER = {
    "priority first, whatever the usage": ([(1, 0, "light"), (2, 5, "heavy")], {"heavy": 100.0}, [2, 1]),
    "equal priority: the least-used user first": ([(1, 0, "heavy"), (2, 0, "light")],
                                                  {"heavy": 10.0, "light": 1.0}, [2, 1]),
    "a user with no usage at all goes before any": ([(1, 0, "a"), (2, 0, "new")], {"a": 0.001}, [2, 1]),
    "equal usage: the older job": ([(3, 0, "a"), (2, 0, "b"), (5, 0, "a")], {"a": 1.0, "b": 1.0}, [2, 3, 5]),
    "one user's jobs keep their age order": ([(4, 0, "a"), (2, 0, "a"), (3, 0, "b")], {"a": 0.0, "b": 5.0},
                                             [2, 4, 3]),
}


@pytest.mark.parametrize("case", ORDER)
def test_placing_order(case):
    jobs, used, want = ORDER[case]
    assert F.placing_order([F.Queued(i, p, u) for i, p, u in jobs], used) == want


# ---- harvest: fair share, quotas, finished jobs ----------------------------------------------
S = HarvestSettings(interval_s=60, idle_samples=3, reclaim_deadline_s=30)


def gpu(host: str, index: int) -> GpuView:
    return GpuView(host=host, index=index, verdict="idle", owner="owner", idle_streak=3, probed_at=NOW - 1)


def running(id: int, user: str, wids_on: list[tuple[str, int]], hi: int = 4, **kw) -> JobView:
    return JobView(id=id, state="running", min_workers=1, max_workers=hi, harvest=True, user=user,
                   workers=tuple(WorkerView(i, h, (d,)) for i, (h, d) in enumerate(wids_on)), **kw)


def grows(p) -> list[tuple[int, str]]:
    return [(a.job, f"{a.host}:{a.devices[0]}") for a in p.of(Grow)]


def test_harvest_grows_the_least_used_users_job_first():
    jobs = [running(1, "heavy", [("c", 0)], hi=2), running(2, "light", [("d", 0)], hi=2)]
    p = plan(jobs, [gpu("a", 0), gpu("a", 1)], S, NOW, share=Share(usage={"heavy": 50.0, "light": 1.0}))
    assert grows(p) == [(2, "a:0"), (1, "a:1")]
    # without usage, the older job first (the fewest-harvested tie-break is equal)
    assert grows(plan(jobs, [gpu("a", 0), gpu("a", 1)], S, NOW)) == [(1, "a:0"), (2, "a:1")]


def test_harvest_grows_only_within_the_users_quota():
    jobs = [running(1, "alice", [("c", 0)]), running(2, "bob", [("d", 0)], hi=2)]
    quotas = {"alice": F.Quota("alice", 2, 1), "bob": F.Quota("bob", None, 1)}
    p = plan(jobs, [gpu("a", i) for i in range(4)], S, NOW, share=Share(usage={"bob": 9.0}, quotas=quotas))
    assert grows(p) == [(1, "a:0"), (2, "a:1")]   # alice stops at 2 GPUs; bob at his MAX


def test_harvest_places_a_queued_job_at_the_size_its_quota_leaves_or_not_at_all():
    queued = JobView(id=3, state="queued", min_workers=1, max_workers=4, user="alice")
    too_big = JobView(id=4, state="queued", min_workers=3, max_workers=3, user="bob")
    quotas = {"alice": F.Quota("alice", 2, 0), "bob": F.Quota("bob", 2, 0)}
    free = [GpuView(host="f", index=i, verdict="free", probed_at=NOW - 1) for i in range(8)]
    p = plan([queued, too_big], free, S, NOW, share=Share(quotas=quotas))
    assert [(a.job, len(a.assignments)) for a in p.of(Place)] == [(3, 2)]


def test_a_finished_job_is_never_grown():
    jobs = [running(1, "alice", [("c", 0)], finished=True)]
    assert grows(plan(jobs, [gpu("a", 0)], S, NOW)) == []
    assert grows(plan([running(1, "alice", [("c", 0)])], [gpu("a", 0)], S, NOW)) == [(1, "a:0")]


FINISHED = {
    "no answer from the coordinator: not known": (None, [0], False),
    "the coordinator says finished": ({"finished": True, "desired": [0, 1]}, [], True),
    "a wanted worker exited 0 (its done record)": ({"finished": False, "desired": [0, 1, 2]}, [2], True),
    "a retired worker exited 0: it left desired first": ({"finished": False, "desired": [0, 1]}, [2], False),
    "running, nobody exited": ({"finished": False, "desired": [0, 1]}, [], False),
}


@pytest.mark.parametrize("case", FINISHED)
def test_training_finished(case):
    status, exited_ok, want = FINISHED[case]
    assert training_finished(None if status is None else parse_status(status), exited_ok) is want
