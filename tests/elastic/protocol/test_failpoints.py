"""Named failpoints (gpuflex/elastic/protocol/failpoints.py): the spec, the filters and hit counts,
each action (the ones that end or stop a process, in a subprocess), bad specs refused,
no effect unarmed, every point placed in the code behind the one-global guard and listed
in the docs, and the spec reaching a job's coordinator and workers."""

from __future__ import annotations

import errno
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpuflex.config import parse_config
from gpuflex.control import launch
from gpuflex.db.models import Job, Worker
from gpuflex.elastic.protocol import failpoints, keys
from gpuflex.elastic.state.checkpoints import load_checkpoint, previous_path, save_checkpoint
from gpuflex.elastic.coordinator.generations import Generations
from tests import REPO as ROOT
from tests.fakes.store_fake import Clock, FakeStore

SOURCES = sorted(p for p in (ROOT / "gpuflex").rglob("*.py") if p.name != "failpoints.py")
CHILD_TIMEOUT_S = 120


@pytest.fixture(autouse=True)
def unarmed():
    failpoints.disarm()
    yield
    failpoints.disarm()


def child(spec: str | None, body: str) -> subprocess.Popen:
    """A python process that imports failpoints with `spec` in its environment, runs `body`
    and prints "after" if it comes back."""
    env = {k: v for k, v in os.environ.items() if k != failpoints.ENV}
    if spec is not None:
        env[failpoints.ENV] = spec
    code = f"from gpuflex.elastic.protocol import failpoints\n{body}\nprint('after', flush=True)\n"
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish(p: subprocess.Popen) -> tuple[int, str, str]:
    out, err = p.communicate(timeout=CHILD_TIMEOUT_S)
    return p.returncode, out, err


# ---- the spec ---------------------------------------------------------------------------------
def test_a_spec_of_several_rules_with_filters_and_arguments():
    rules = failpoints.arm(" resize.copy@wid=2,rank=-1,gen=3,step=10,hit=2=kill ;"
                           "checkpoint.write=oserror:ENOSPC; steady.collective=sleep:0.5; cancel.stop=exit:3;")
    assert [(r.name, r.action, r.arg, r.filters) for r in rules] == [
        ("resize.copy", "kill", "", {"wid": 2, "rank": -1, "gen": 3, "step": 10, "hit": 2}),
        ("checkpoint.write", "oserror", "ENOSPC", {}),
        ("steady.collective", "sleep", "0.5", {}),
        ("cancel.stop", "exit", "3", {}),
    ]
    assert failpoints.ARMED


BAD = [
    ("no action", "resize.copy", "expected NAME"),
    ("an unknown point", "resize.cpy=kill", "unknown failpoint 'resize.cpy'"),
    ("an unknown action", "resize.copy=kil", "unknown action 'kil'"),
    ("an unknown filter", "resize.copy@worker=1=kill", "bad filter 'worker=1'"),
    ("a filter without a value", "resize.copy@wid=kill", "bad filter 'wid'"),
    ("a value that is no integer", "resize.copy@wid=x=kill", "wid needs an integer"),
    ("unicode digits", "resize.copy@wid=²=kill", "wid needs an integer"),
    ("a filter twice", "resize.copy@wid=1,wid=2=kill", "given twice"),
    ("an empty filter list", "resize.copy@=kill", "empty filter list"),
    ("hit 0", "resize.copy@hit=0=kill", "hit counts from 1"),
    ("kill with an argument", "resize.copy=kill:9", "kill takes no argument"),
    ("exit without a status", "resize.copy=exit", "exit needs a status"),
    ("exit above 255", "resize.copy=exit:256", "exit needs a status"),
    ("sleep without seconds", "resize.copy=sleep", "sleep needs seconds"),
    ("negative sleep", "resize.copy=sleep:-1", "sleep needs seconds"),
    ("an unknown errno", "resize.copy=oserror:ENOPE", "oserror needs an errno name"),
    ("not an errno name", "resize.copy=oserror:errorcode", "oserror needs an errno name"),
]


@pytest.mark.parametrize("spec,why", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_a_bad_rule_is_refused_by_name_and_arms_nothing(spec, why):
    with pytest.raises(failpoints.FailpointSpecError) as e:
        failpoints.arm(f"cancel.stop=kill; {spec}")
    assert e.value.rule == spec and why in str(e.value) and failpoints.ENV in str(e.value)
    assert not failpoints.ARMED   # all or nothing: the good rule before it is not armed either


def test_a_process_started_with_a_bad_spec_exits_2_with_one_error_line():
    rc, out, err = finish(child("resize.copy=kil", ""))
    assert rc == 2 and out == ""
    assert err.splitlines() == [
        f"error: {failpoints.ENV}: bad rule 'resize.copy=kil': unknown action 'kil': "
        "one of kill, stop, exit, raise, sleep, oserror"]


def test_an_empty_spec_arms_nothing():
    assert failpoints.arm(" ; ") == [] and not failpoints.ARMED


# ---- filters and hit counts -------------------------------------------------------------------
def fires(name: str, **ctx) -> bool:
    try:
        failpoints.hit(name, **ctx)
    except RuntimeError:
        return True
    return False


def test_filters_must_all_hold_and_step_is_at_least():
    failpoints.arm("resize.copy@wid=2,gen=3,step=10=raise")
    assert not fires("resize.copy", wid=1, gen=3, step=10)
    assert not fires("resize.copy", wid=2, gen=4, step=10)
    assert not fires("resize.copy", wid=2, gen=3, step=9)
    assert not fires("resize.copy", wid=2, step=10)        # the place did not say its generation
    assert not fires("resize.copy", wid=True, gen=3, step=10)   # a bool is no worker id
    assert not fires("resize.verify", wid=2, gen=3, step=10)
    assert fires("resize.copy", wid=2, gen=3, step=12, rank=0)


def test_a_rule_fires_once_per_process():
    failpoints.arm("resize.copy=raise")
    assert [fires("resize.copy") for _ in range(3)] == [True, False, False]


def test_hit_counts_only_the_times_the_other_filters_held():
    failpoints.arm("resize.copy@rank=1,hit=3=raise")
    seen = [fires("resize.copy", rank=r) for r in (1, 0, 1, 0, 0, 1, 1, 1)]
    assert seen == [False, False, False, False, False, True, False, False]


def test_sleep_fires_every_time_its_filters_hold(capfd):
    failpoints.arm("steady.collective@step=2=sleep:0")
    for step in range(4):
        failpoints.hit("steady.collective", step=step)
    lines = capfd.readouterr().err.splitlines()
    assert lines == [f"failpoint steady.collective sleep:0 pid={os.getpid()} step={s}" for s in (2, 3)]


def test_two_rules_on_one_point_each_count_for_themselves():
    failpoints.arm("resize.copy@wid=1=oserror:EIO; resize.copy@wid=2=raise")
    with pytest.raises(OSError) as e:
        failpoints.hit("resize.copy", wid=1)
    assert e.value.errno == errno.EIO
    assert fires("resize.copy", wid=2) and not fires("resize.copy", wid=1)


# ---- actions ----------------------------------------------------------------------------------
def test_raise_says_which_point_after_its_line(capfd):
    failpoints.arm("formation.verify=raise")
    with pytest.raises(RuntimeError, match="^failpoint formation.verify$"):
        failpoints.hit("formation.verify", wid=3, gen=1, kind="initial")
    assert capfd.readouterr().err == f"failpoint formation.verify raise pid={os.getpid()} wid=3 gen=1 kind=initial\n"


def test_oserror_is_the_named_errno_as_a_full_disk_would_be():
    failpoints.arm("checkpoint.write=oserror:ENOSPC")
    with pytest.raises(OSError) as e:
        failpoints.hit("checkpoint.write", step=4)
    assert e.value.errno == errno.ENOSPC and "failpoint checkpoint.write" in str(e.value)


def test_kill_sigkills_the_process_after_its_line():
    rc, out, err = finish(child("resize.copy@rank=1=kill",
                                'failpoints.hit("resize.copy", rank=0)\nfailpoints.hit("resize.copy", rank=1)'))
    assert rc == -signal.SIGKILL and out == ""
    assert re.fullmatch(r"failpoint resize\.copy kill pid=\d+ rank=1\n", err)


def test_exit_ends_the_process_with_that_status():
    rc, out, err = finish(child("cancel.stop=exit:7", 'failpoints.hit("cancel.stop", wid=0)'))
    assert (rc, out) == (7, "") and err.startswith("failpoint cancel.stop exit:7 pid=")


def test_stop_stops_the_process_until_it_is_continued():
    p = child("steady.collective=stop", 'failpoints.hit("steady.collective", step=1)')
    try:
        _, status = os.waitpid(p.pid, os.WUNTRACED)   # returns once it stopped (or ended)
        assert os.WIFSTOPPED(status) and os.WSTOPSIG(status) == signal.SIGSTOP
        os.kill(p.pid, signal.SIGCONT)
        rc, out, err = finish(p)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert (rc, out) == (0, "after\n") and err.startswith("failpoint steady.collective stop pid=")


def test_armed_from_the_environment_at_import():
    rc, out, err = finish(child("scale.spawned=exit:4", 'assert failpoints.ARMED\nfailpoints.hit("scale.spawned")'))
    assert (rc, out) == (4, "") and "failpoint scale.spawned exit:4" in err


# ---- unarmed ----------------------------------------------------------------------------------
def test_unarmed_no_point_does_anything():
    rc, out, err = finish(child(None, "assert not failpoints.ARMED\n"
                                      "for name in failpoints.POINTS: failpoints.hit(name, wid=0, rank=0, gen=1, step=0)"))
    assert (rc, out, err) == (0, "after\n", "")


def test_disarm_ends_every_rule():
    failpoints.arm("resize.copy=raise")
    failpoints.disarm()
    assert not failpoints.ARMED and not fires("resize.copy")


def test_a_place_that_is_not_a_point_is_a_bug_even_unarmed():
    with pytest.raises(KeyError, match="resize.cpy"):
        failpoints.hit("resize.cpy")


# ---- two places, in process --------------------------------------------------------------------
def test_oserror_at_checkpoint_write_is_a_full_disk_the_old_checkpoints_intact(tmp_path):
    path = str(tmp_path / "checkpoint.pt")
    for step in (1, 2):
        save_checkpoint(path, {"state": {"step": step, "w": torch.full((3,), float(step))}})
    failpoints.arm("checkpoint.write@step=3=oserror:ENOSPC")
    with pytest.raises(OSError) as e:
        save_checkpoint(path, {"state": {"step": 3, "w": torch.zeros(3)}})
    assert e.value.errno == errno.ENOSPC
    assert sorted(os.listdir(tmp_path)) == ["checkpoint.prev.pt", "checkpoint.pt"]   # no temp file left
    assert load_checkpoint(path)["state"]["step"] == 2 and load_checkpoint(previous_path(path))["state"]["step"] == 1
    save_checkpoint(path, {"state": {"step": 4, "w": torch.zeros(3)}})   # fired once: the next write works
    assert load_checkpoint(path)["state"]["step"] == 4


def test_a_fault_at_coordinator_publish_comes_before_the_generation_is_published():
    store, clock = FakeStore(), Clock()
    gens = Generations(store, [0, 1], hb_timeout_s=3, clock=clock, wall=clock)
    for w in (0, 1):
        store.add(keys.hb(w), 1)
        store.set(keys.ready(w), "0")
    store.add(keys.EVENTS, 1)
    failpoints.arm("coordinator.publish@gen=1=raise")
    with pytest.raises(RuntimeError, match="failpoint coordinator.publish"):
        gens.tick()
    assert keys.members(1) not in store.data and gens.generation == 0
    gens.tick()   # fired once: the next look publishes
    assert gens.generation == 1 and keys.members(1) in store.data


# ---- the points in the code and the docs ------------------------------------------------------
def source_lines() -> list[tuple[Path, int, str]]:
    return [(p, i, line) for p in SOURCES for i, line in enumerate(p.read_text().splitlines())]


def test_every_point_is_placed_in_the_code_and_every_place_is_a_point():
    text = "\n".join(line for _, _, line in source_lines())
    placed = set(re.findall(r'"([a-z_]+\.[a-z_]+)"', text)) & set(failpoints.POINTS)
    assert placed == set(failpoints.POINTS)
    named = set(re.findall(r'failpoints\.hit\("([^"]+)"', text))
    assert named and named <= set(failpoints.POINTS)


def test_every_call_is_behind_the_one_global_test():
    lines = source_lines()
    calls = [(p, i) for p, i, line in lines if "failpoints.hit(" in line]
    assert len(calls) >= 10
    for p, i in calls:
        here = p.read_text().splitlines()
        guard = here[i] if "failpoints.ARMED" in here[i] else here[i - 1]
        assert "if failpoints.ARMED" in guard, f"{p.name}:{i + 1} calls failpoints.hit unguarded"


def test_the_docs_list_every_point():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    section = doc.split("\n## Failpoints", 1)[1].split("\n## ", 1)[0]
    assert [n for n in failpoints.POINTS if f"`{n}`" not in section] == []


# ---- a job's processes get the submitter's spec -----------------------------------------------
def job(submit_env: dict[str, str] | None) -> Job:
    return Job(id=7, token="tok", secret="s", name="j", argv=["python", "t.py"], workdir="/w", env={},
               min_workers=1, max_workers=2, gpus_per_worker=1, user="u", store_addr="127.0.0.1",
               store_port=1, socket_dir="/tmp/gpuflex-x", submit_env=submit_env)


def test_the_submit_environment_keeps_the_spec_and_drops_other_gpuflex_variables():
    kept = launch.submit_environment({failpoints.ENV: "resize.copy=kill", "GPUFLEX_STORE": "h:1", "A": "a"}, {})
    assert kept == {failpoints.ENV: "resize.copy=kill", "A": "a"}


ARMED_JOBS = [
    ("armed at submit", {failpoints.ENV: "coordinator.publish=kill"}, {}, "coordinator.publish=kill"),
    ("armed by --env", {"PATH": "/bin"}, {failpoints.ENV: "cancel.stop=kill"}, "cancel.stop=kill"),
    ("--env over submit", {failpoints.ENV: "coordinator.publish=kill"}, {failpoints.ENV: ""}, ""),
    ("not armed at submit", {"PATH": "/bin"}, {}, ""),
    ("a job from before submit_env", None, {}, ""),
]


@pytest.mark.parametrize("submit_env,env,spec", [a[1:] for a in ARMED_JOBS], ids=[a[0] for a in ARMED_JOBS])
def test_the_coordinator_gets_the_workers_spec_whatever_the_starters(monkeypatch, submit_env, env, spec):
    monkeypatch.setenv(failpoints.ENV, "resize.copy=kill")   # the command that starts it
    cfg = parse_config({"hosts": [{"name": "h", "gpus": "cpu:2"}]}, "f.toml")
    armed = job(submit_env)
    armed.env = env
    coord = launch.coordinator_spec(cfg, cfg.hosts[0], armed, 1234, [0, 1])
    assert coord.env[failpoints.ENV] == spec
    w = Worker(wid=0, host="h", gpus=[0], log_path="~/l", exit_path="~/e")
    worker = launch.worker_spec(cfg, cfg.hosts[0], armed, w, rank=0, world=1)
    assert worker.env.get(failpoints.ENV, "") == spec   # a job from before submit_env: the starter's
