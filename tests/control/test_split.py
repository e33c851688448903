"""The control side of issue 12 (mixed GPUs): `submit --split`, what each in-place worker is
told (GPUFLEX_SPLIT, GPUFLEX_SPEED_HINT, GPUFLEX_STRAGGLER_FACTOR), the workers' shares in
`status`, re-plan events and the release of a straggler.

The runtime's progress record is given as the contract shapes it (docs/architecture.md,
"Mixed GPUs"), through simulated hosts (tests/fakes/hosts.py): the real service, DB,
policy and executor, no processes."""

from __future__ import annotations

import dataclasses
import json

import pytest
from typer.testing import CliRunner

import gpuflex.cli.render as render
from gpuflex.cli import app
from gpuflex.cli.hosts_cmd import with_speeds
from gpuflex.config import load_config, parse_config
from gpuflex.control import launch as L
from gpuflex.control import split
from gpuflex.control.harvest_inputs import shunned, snapshot
from gpuflex.control.observe import coordinator_status
from gpuflex.control.pool import Pool
from gpuflex.control.requests import SubmitRequest
from gpuflex.control.service import JobService
from gpuflex.control.views import worker_split
from gpuflex.errors import JobError, UsageError
from gpuflex.jobspec import split_mode
from gpuflex.policy.placement import Assignment, HostFree, place
from gpuflex.policy.split import REGROW_AFTER_S, Member, Release, new_replans, replan_message, straggler
from gpuflex.states import JobState as J
from gpuflex.states import WorkerState as W
from tests.conftest import db_dump, write_config
from tests.fakes.hosts import FakeHost, World


# ---- submit --split ------------------------------------------------------------------
@pytest.mark.parametrize("value,elastic,expected", [
    (None, "inplace", "speed"),            # the default for an in-place job
    ("even", "inplace", "even"),
    (" Speed ", "inplace", "speed"),
    (None, None, None),                    # a gang divides its own batch
    (None, "restart", None),
])
def test_split_mode_by_value_and_elastic_mode(value, elastic, expected):
    assert split_mode(value, elastic) == expected


@pytest.mark.parametrize("value,elastic,words", [
    ("fast", "inplace", "--split 'fast': give speed"),
    ("", "inplace", "--split '': give speed"),
    ("even", None, "--split even applies to in-place jobs"),
    ("speed", "restart", "this is a restart job"),
])
def test_a_bad_split_or_one_for_a_gang_is_refused_naming_it(value, elastic, words):
    with pytest.raises(UsageError, match=words.replace("(", r"\(")):
        split_mode(value, elastic)


@pytest.mark.parametrize("args,words", [
    (["--split", "fast", "--workers", "1:2"], "--split 'fast': give speed"),
    (["--split", "even", "--workers", "2"], "--split even applies to in-place jobs"),
])
def test_submit_with_a_bad_split_exits_2_with_one_line_and_changes_nothing(config_path, db_path, home, args, words):
    JobService(load_config(str(config_path))).refresh()
    before = db_dump(db_path)
    r = CliRunner().invoke(app, ["submit", *args, "--", "python3", "train.py"],
                           env={"HOME": str(home), "GPUFLEX_CONFIG": str(config_path)})
    assert r.exit_code == 2
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: ") and words in r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    assert db_dump(db_path) == before


# ---- simulated hosts ---------------------------------------------------------------------
@pytest.fixture
def sim(tmp_path):
    """Two 2-GPU hosts: "fast" (A100s) and "slow" (2080 Tis); [jobs] straggler_s 60."""
    world = World(warmup_s=0.0, leave_s=(0.0, 0.0), gpus_per_host=2)
    world.models = {"fast": "NVIDIA A100-SXM4-80GB", "slow": "NVIDIA GeForce RTX 2080 Ti"}
    cfg = parse_config({"database": {"url": f"sqlite:///{tmp_path}/g.db"},
                        "jobs": {"straggler_factor": 2.5, "straggler_s": 60},
                        "hosts": [{"name": "fast", "address": "10.9.1.1", "workdir": "/w"},
                                  {"name": "slow", "address": "10.9.1.2", "workdir": "/w"}]}, "<test>")
    svc = JobService(cfg, pool=Pool(cfg, lambda host: FakeHost(host, world)))
    yield world, svc
    svc.close()


def submit(world: World, svc: JobService, tmp_path, workers: str = "1:4", **kw) -> tuple[int, str]:
    lo, _, hi = workers.partition(":")
    job_id = svc.submit(SubmitRequest(argv=["python3", "train.py"], min_workers=int(lo), max_workers=int(hi or lo),
                                      workdir=str(tmp_path), **kw))
    with svc.sessions() as s:
        token = svc.get(s, job_id).token
    # the simulated coordinator formed its first generation of the workers spawned by then
    # (worker 0); the real one waits for all its --members: so does this one, asked again
    world.jobs[token].desired = sorted(world.workers(token))
    svc.refresh()
    svc.refresh()
    assert all(w.state is W.RUNNING for w in svc.job(job_id, events=False).workers)
    return job_id, token


def test_an_in_place_worker_is_told_the_split_its_speed_hint_and_the_straggler_factor(sim, tmp_path):
    world, svc = sim
    job_id, token = submit(world, svc, tmp_path)
    procs = world.workers(token)
    assert len(procs) == 4 and svc.job(job_id).split == "speed"
    hints = {(p.host, p.env["GPUFLEX_SPLIT"], p.env["GPUFLEX_SPEED_HINT"], p.env["GPUFLEX_STRAGGLER_FACTOR"])
             for p in procs.values()}
    assert hints == {("fast", "speed", "2.6", "2.5"), ("slow", "speed", "0.75", "2.5")}


def test_even_is_stored_shown_and_passed_on(sim, tmp_path):
    world, svc = sim
    job_id, token = submit(world, svc, tmp_path, "1:2", split="even")
    assert render.job_json(svc.job(job_id, events=False))["split"] == "even"
    assert {p.env["GPUFLEX_SPLIT"] for p in world.workers(token).values()} == {"even"}


def test_a_gang_gets_no_split_variables_and_no_split(sim, tmp_path):
    world, svc = sim
    job_id, token = submit(world, svc, tmp_path, "2")
    assert svc.job(job_id).split is None
    assert all(L.SPLIT not in p.env and L.SPEED_HINT not in p.env for p in world.workers(token).values())


def test_a_job_from_before_split_runs_even_and_a_hosts_speed_beats_the_table(sim, tmp_path):
    world, svc = sim
    job_id, token = submit(world, svc, tmp_path, "1:2")
    with svc.locked() as s:
        job = svc.get(s, job_id)
        job.split = None                                  # as migration 0008 leaves an old job
        w = job.members[0]
        host = svc.config.host(w.host)
        assert L.split_env(svc.config, host, job, w)[L.SPLIT] == "even"
        faster = dataclasses.replace(host, speed=9.0)
        assert L.split_env(svc.config, faster, job, w)[L.SPEED_HINT] == "9.0"


# ---- status: each worker's share -----------------------------------------------------------
def progress_record(time: float = 1000.0, slow_since: dict[int, float] | None = None, **extra) -> dict:
    slow_since = slow_since or {}
    return {"step": 40, "epoch": 0, "samples_per_s": 900.0, "loss": 0.5, "time": time, "split": "speed",
            "workers": {str(w): {"share": s, "samples_per_s": r, "relative": rel, "slow_since": slow_since.get(w)}
                        for w, s, r, rel in ((0, 48, 600.0, 1.0), (1, 48, 590.0, 0.98), (2, 16, 200.0, 0.33),
                                             (3, 16, 198.0, 0.33))},
            **extra}


def test_worker_split_reads_the_record_and_drops_what_is_not_the_contract():
    rec = progress_record()
    assert worker_split(rec, 2) == {"share": 16, "samples_per_s": 200.0, "relative": 0.33}
    assert worker_split(rec, 9) == {"share": None, "samples_per_s": None, "relative": None}
    assert worker_split(None, 0) == worker_split({"workers": []}, 0) == worker_split(9, 0)
    odd = {"workers": {"0": {"share": True, "samples_per_s": float("nan"), "relative": "1.0"},
                       "1": {"share": -3, "samples_per_s": 5, "relative": float("inf")}, "2": "x"}}
    unknown = {"share": None, "samples_per_s": None, "relative": None}
    assert worker_split(odd, 0) == worker_split(odd, 2) == unknown
    assert worker_split(odd, 1) == {**unknown, "samples_per_s": 5.0}


def test_status_shows_each_workers_share_samples_and_relative_speed(sim, tmp_path):
    world, svc = sim
    job_id, token = submit(world, svc, tmp_path)
    world.progress[token] = progress_record()
    svc.refresh()
    info = svc.job(job_id, events=False)
    doc = render.job_json(info, progress=svc.progress.get(job_id))
    by_wid = {w["wid"]: (w["share"], w["samples_per_s"], w["relative"]) for w in doc["workers"]}
    assert by_wid == {0: (48, 600.0, 1.0), 1: (48, 590.0, 0.98), 2: (16, 200.0, 0.33), 3: (16, 198.0, 0.33)}
    table = render.workers_table(info, svc.progress.get(job_id))
    assert [c.header for c in table.columns][-3:] == ["SHARE", "SAMPLES/S", "SPEED"]
    assert list(table.columns[-1].cells) == ["1.00x", "0.98x", "0.33x", "0.33x"]
    plain = render.workers_table(info, None)
    assert "SHARE" not in [c.header for c in plain.columns]        # nothing reported: no columns
    assert render.job_json(info)["workers"][0]["share"] is None


# ---- re-plan events ----------------------------------------------------------------------
def replan(seq: int, step: int, time: float, old: dict, new: dict, reason: str = "speeds") -> dict:
    return {"seq": seq, "step": step, "reason": reason, "old": old, "new": new, "predicted_step_s": 0.25,
            "previous_step_s": 0.5 if old else None, "time": time}


START = replan(1, 0, 100.0, {}, {"0": 32, "1": 32, "2": 32, "3": 32}, "start")
SPEEDS = replan(2, 12, 160.0, START["new"], {"0": 48, "1": 48, "2": 16, "3": 16})


@pytest.mark.parametrize("replans,last_seq,last_time,expected", [
    ([START, SPEEDS], None, None, [1, 2]),           # nothing recorded: all
    ([START, SPEEDS], 1, 100.0, [2]),                # after the newest recorded
    ([START, SPEEDS], 2, 160.0, []),
    ([START], 5, 900.0, []),                         # carried over from an older checkpoint
    ([START, replan(2, 12, 950.0, {}, {"0": 64, "1": 64}, "membership")], 5, 900.0, [2]),  # seq reused, later
    ([{"seq": "3"}, None, SPEEDS, {"seq": 4, "step": 1, "time": 1.0, "new": {"a": 1}}], None, None, [2]),
])
def test_new_replans_by_seq_or_time(replans, last_seq, last_time, expected):
    assert [r["seq"] for r in new_replans({"replans": replans}, last_seq, last_time)] == expected


def test_a_replan_reads_as_one_line_of_old_and_new_shares_and_the_predicted_step():
    assert replan_message(SPEEDS) == ("re-plan 2 at step 12 (speeds): w0 32, w1 32, w2 32, w3 32 -> "
                                      "w0 48, w1 48, w2 16, w3 16; predicted step 0.250 s (was 0.500 s)")
    assert replan_message(START) == "re-plan 1 at step 0 (start): shares w0 32, w1 32, w2 32, w3 32; " \
                                    "predicted step 0.250 s"


def follow(svc: JobService, job_id: int, now: float = 1000.0) -> None:
    with svc.locked() as s:
        job = svc.get(s, job_id)
        split.follow(svc.ops(s), job, coordinator_status(svc.config, svc.pool, job), now=now)


def test_each_replan_becomes_one_event_once(sim, tmp_path):
    world, svc = sim
    job_id, token = submit(world, svc, tmp_path)
    world.progress[token] = progress_record(replans=[START])
    follow(svc, job_id)
    world.progress[token] = progress_record(replans=[START, SPEEDS])
    follow(svc, job_id)
    follow(svc, job_id)
    events = [e for e in svc.job(job_id).events if e.kind == "replan"]
    assert [(e.data["seq"], e.count) for e in events] == [(1, 1), (2, 1)]
    assert events[1].message == replan_message(SPEEDS) and events[1].data["new"] == SPEEDS["new"]
    table = render.events_table(svc.job(job_id), events)
    assert list(table.columns[2].cells) == [replan_message(START), replan_message(SPEEDS)]


# ---- stragglers ----------------------------------------------------------------------------
MEMBERS = [Member(0, "fast"), Member(1, "fast"), Member(2, "slow"), Member(3, "slow")]


@pytest.mark.parametrize("members,minimum,slow,expected", [
    (MEMBERS, 1, {}, None),                                        # nobody slow
    (MEMBERS, 1, {2: 950.0}, None),                                # slow 50 s < 60
    (MEMBERS, 1, {2: 940.0}, Release(2, "slow", 0.33, 60.0)),      # slow exactly straggler_s
    (MEMBERS, 1, {2: 900.0, 3: 800.0}, Release(3, "slow", 0.33, 200.0)),   # the one slow the longest
    (MEMBERS, 4, {2: 800.0}, None),                                # at MIN: never below
    (MEMBERS[:2], 1, {2: 800.0}, None),                            # not a member (already leaving)
])
def test_straggler_by_table(members, minimum, slow, expected):
    assert straggler(members, minimum, progress_record(slow_since=slow), 60, now=5000.0) == expected


def test_a_straggler_is_timed_on_the_records_clock_else_now():
    rec = progress_record(slow_since={1: 900.0})
    del rec["time"]
    assert straggler(MEMBERS, 1, rec, 60, now=950.0) is None
    assert straggler(MEMBERS, 1, rec, 60, now=990.0) == Release(1, "fast", 0.98, 90.0)
    assert straggler(MEMBERS, 1, None, 60, now=990.0) is None
    assert straggler(MEMBERS, 1, {"workers": {"1": {"slow_since": True}}}, 60, now=990.0) is None


def test_a_straggler_is_shrunk_away_in_place_and_its_gpu_is_freed(sim, tmp_path):
    world, svc = sim
    job_id, token = submit(world, svc, tmp_path)
    slow = next(w.wid for w in svc.job(job_id).workers if w.host == "slow")
    world.progress[token] = progress_record(slow_since={slow: 900.0})
    follow(svc, job_id)
    info = svc.job(job_id)
    assert {w.wid: w.state for w in info.workers}[slow] is W.LEAVING
    assert world.jobs[token].desired == sorted(w.wid for w in info.workers if w.wid != slow)
    ev = [e for e in info.events if e.kind == "straggler"]
    assert len(ev) == 1 and ev[0].data == {"worker": slow, "host": "slow", "relative": 0.33, "slow_for_s": 100.0,
                                           "escalated": False}
    assert f"worker {slow} on slow is a straggler: 0.33x the fastest member" in ev[0].message
    follow(svc, job_id)                               # a resize is under way: nothing more
    assert len([e for e in svc.job(job_id).events if e.kind == "straggler"]) == 1
    svc.refresh()
    svc.refresh()
    info = svc.job(job_id, events=False)
    assert (info.state, info.world_size) == (J.RUNNING, 3)
    assert ("slow", slow) not in {(w.host, w.wid) for w in info.workers if not w.state.final}


def test_harvest_does_not_grow_a_job_back_onto_its_released_stragglers_gpu(sim, tmp_path):
    """The straggler's GPU is shunned for that job (REGROW_AFTER_S), not for others, and
    not once that time has passed."""
    world, svc = sim
    job_id, token = submit(world, svc, tmp_path)
    gone = next(w for w in svc.job(job_id).workers if w.host == "slow")
    world.progress[token] = progress_record(slow_since={gone.wid: 900.0})
    follow(svc, job_id)
    with svc.sessions() as session:
        views = {j.id: j for j in snapshot(session, svc.config)[0]}
        assert views[job_id].shunned == frozenset(("slow", d) for d in gone.gpus)
        e = next(e for e in svc.get(session, job_id).events if e.kind == "straggler")
        assert shunned(session, e.time + REGROW_AFTER_S + 1) == {}


def test_harvest_grows_another_users_job_only_where_it_could_start_it(sim, tmp_path):
    """Both hosts are reached as each user: the caller's harvest tick would start zed's
    newcomer as the caller, so every device is closed to zed's job; its own job's are not."""
    world, svc = sim
    job_id, _ = submit(world, svc, tmp_path)
    with svc.sessions() as session:
        assert snapshot(session, svc.config)[0][0].shunned == frozenset()
    with svc.sessions.begin() as session:
        svc.get(session, job_id).user = "zed"
    with svc.sessions() as session:
        assert snapshot(session, svc.config)[0][0].shunned == {(h, d) for h in ("fast", "slow") for d in (0, 1)}


def test_a_job_at_its_min_keeps_its_straggler(sim, tmp_path):
    world, svc = sim
    job_id, token = submit(world, svc, tmp_path, "4:4", elastic="inplace")
    world.progress[token] = progress_record(slow_since={2: 100.0, 3: 100.0})
    follow(svc, job_id)
    assert not [e for e in svc.job(job_id).events if e.kind == "straggler"]
    assert all(w.state is W.RUNNING for w in svc.job(job_id).workers)


def test_a_refused_shrink_kills_the_straggler_instead(sim, tmp_path, monkeypatch):
    world, svc = sim
    job_id, token = submit(world, svc, tmp_path)
    world.progress[token] = progress_record(slow_since={3: 100.0})

    def refused(*a, **kw):
        raise JobError("coordinator refused resize: busy")

    monkeypatch.setattr(split.scaling, "retire", refused)
    follow(svc, job_id)
    info = svc.job(job_id)
    ev = [e for e in info.events if e.kind == "straggler"]
    assert len(ev) == 1 and ev[0].data["escalated"] is True and "killed" in ev[0].message
    assert not world.workers(token)[3].alive
    assert {w.wid: w.state for w in info.workers}[3].final


# ---- placement keeps a gang on one GPU model when it can without waiting ------------------------
A100, T4, RTX = "NVIDIA A100-SXM4-80GB", "Tesla T4", "NVIDIA GeForce RTX 3090"


def gpus(name: str, *devices: tuple[int, str | None]) -> HostFree:
    return HostFree(name, tuple(d for d, _ in devices), models=tuple(m for _, m in devices))


# (id, free hosts, minimum, maximum, expected assignments)
ONE_MODEL = [
    ("the fewest-hosts fill mixes models: one model instead, as many workers",
     [gpus("a", (0, A100), (1, T4), (2, T4)), gpus("b", (0, A100))], 2, 2,
     (Assignment("a", (1,)), Assignment("a", (2,)))),
    ("two models can: the one on fewer hosts",
     [gpus("a", (0, A100), (1, T4)), gpus("b", (0, A100), (1, T4)), gpus("c", (0, T4), (1, T4))], 2, 2,
     (Assignment("c", (0,)), Assignment("c", (1,)))),
    ("equal hosts: the faster model",
     [gpus("a", (0, T4), (1, A100)), gpus("b", (0, T4), (1, A100))], 2, 2,
     (Assignment("a", (1,)), Assignment("b", (1,)))),
    ("no one model holds as many workers: mixed, at once",
     [gpus("a", (0, A100), (1, T4), (2, RTX))], 1, 3,
     (Assignment("a", (0,)), Assignment("a", (1,)), Assignment("a", (2,)))),
    ("one model for fewer workers is not preferred to more workers now",
     [gpus("a", (0, A100), (1, A100), (2, T4))], 2, 3,
     (Assignment("a", (0,)), Assignment("a", (1,)), Assignment("a", (2,)))),
    ("already one model: unchanged",
     [gpus("a", (0, T4), (1, T4)), gpus("b", (0, A100))], 2, 2,
     (Assignment("a", (0,)), Assignment("a", (1,)))),
    ("models not known: unchanged",
     [gpus("a", (0, None), (1, None)), gpus("b", (0, None))], 2, 2,
     (Assignment("a", (0,)), Assignment("a", (1,)))),
    ("an unknown model beside a known one: the known one",
     [gpus("a", (0, None), (1, A100)), gpus("b", (0, A100))], 2, 2,
     (Assignment("a", (1,)), Assignment("b", (0,)))),
]


@pytest.mark.parametrize("free,lo,hi,expected", [row[1:] for row in ONE_MODEL], ids=[row[0] for row in ONE_MODEL])
def test_placement_prefers_one_gpu_model(free, lo, hi, expected):
    p = place(free, lo, hi, 1)
    assert p.ok and p.assignments == expected


def test_one_model_keeps_k_gpus_per_worker_and_waits_for_nothing():
    free = [gpus("a", (0, T4), (1, A100), (2, A100), (3, T4)), gpus("b", (0, A100), (1, A100))]
    assert place(free, 1, 1, 2).assignments == (Assignment("a", (1, 2)),)
    assert place(free, 2, 2, 2).assignments == (Assignment("a", (1, 2)), Assignment("b", (0, 1)))
    assert not place([gpus("a", (0, T4))], 2, 2, 1).ok      # waiting is as before: MIN does not fit


# ---- hosts: each GPU's model and first-guess speed ------------------------------------------
def test_hosts_json_gives_each_gpus_model_and_its_speed_guess(sim):
    world, svc = sim
    svc.refresh(probe=True)
    view = {h["name"]: h for h in with_speeds(svc.hosts(), {"fast": None, "slow": 0.5})}
    assert [(d["model"], d["speed"]) for d in view["fast"]["devices"]] == [("NVIDIA A100-SXM4-80GB", 2.6)] * 2
    assert [(d["model"], d["speed"]) for d in view["slow"]["devices"]] == [("NVIDIA GeForce RTX 2080 Ti", 0.5)] * 2


def test_the_hosts_table_has_a_speed_column(home):
    cfg = write_config(home, slots=2, extra="speed = 0.5\n")
    env = {"HOME": str(home), "GPUFLEX_CONFIG": str(cfg), "COLUMNS": "200"}
    r = CliRunner().invoke(app, ["hosts", "--json"], env=env)
    assert r.exit_code == 0 and [d["speed"] for d in json.loads(r.stdout)[0]["devices"]] == [0.5, 0.5]
    r = CliRunner().invoke(app, ["hosts"], env=env)
    assert r.exit_code == 0
    header = next(line for line in r.stdout.splitlines() if "MODEL" in line).split()
    assert header[header.index("MODEL") + 2] == "SPEED"   # a column separator between them
    rows = [line.split() for line in r.stdout.splitlines() if "slot" in line]
    assert len(rows) == 2 and all(row[row.index("slot") + 5] == "0.5" for row in rows)


def test_a_refresh_records_the_replans_and_releases_the_straggler(sim, tmp_path):
    """What every command does first (JobService.refresh) follows the split: no call of
    control/split by hand."""
    world, svc = sim
    job_id, token = submit(world, svc, tmp_path)
    world.progress[token] = progress_record(time=1e12, slow_since={3: 1.0}, replans=[START, SPEEDS])
    svc.refresh()
    info = svc.job(job_id)
    assert [e.data["seq"] for e in info.events if e.kind == "replan"] == [1, 2]
    assert [e.data["worker"] for e in info.events if e.kind == "straggler"] == [3]
    assert world.jobs[token].desired == [0, 1, 2]


def test_a_gang_is_placed_on_one_gpu_model_when_the_pool_allows(tmp_path):
    world = World(warmup_s=0.0, leave_s=(0.0, 0.0), gpus_per_host=2)
    world.models = {"a": T4, "b": A100, "c": A100}
    cfg = parse_config({"database": {"url": f"sqlite:///{tmp_path}/g.db"},
                        "hosts": [{"name": n, "address": f"10.9.1.{i}", "workdir": "/w"}
                                  for i, n in enumerate("abc", 1)]}, "<test>")
    svc = JobService(cfg, pool=Pool(cfg, lambda host: FakeHost(host, world)))
    try:
        job_id = svc.submit(SubmitRequest(argv=["python3", "train.py"], min_workers=3, max_workers=3,
                                          workdir=str(tmp_path)))
        assert sorted(w.host for w in svc.job(job_id).workers) == ["b", "b", "c"]   # not a, a, b
    finally:
        svc.close()
