"""gpuflex.cli.harvest_cmd: how a harvest tick is printed, and `report`'s and `watch`'s
checks of their options (ticks against real and fake GPU hosts: tests/e2e/test_harvest_cmd_local.py,
tests/e2e/ssh/test_harvest_e2e.py)."""

from __future__ import annotations

import json

import pytest

from gpuflex.cli import harvest_cmd
from gpuflex.control.harvest import TickResult
from tests.clirun import invoke

ACTIONS = [
    {"action": "reclaim", "host": "gpu01", "gpu": 2, "job": 4, "latency_s": 1.234, "method": "shrink",
     "deadline_s": 30.0, "ok": True},
    {"action": "reclaim", "host": "gpu01", "gpu": 3, "job": 4, "latency_s": None, "method": "requeue",
     "deadline_s": 30.0, "ok": False},
    {"action": "grow", "job": 5, "gpus": [["gpu02", 0]], "wids": [3], "ok": True},
    {"action": "grow", "job": 6, "gpus": [["gpu02", 1]], "ok": False, "error": "spawn failed"},
    {"action": "place", "job": 7, "gpus": [], "ok": True},
    {"action": "grow", "job": 8, "skipped": "over quota"},
]


def test_each_action_of_a_tick_is_one_line(capsys):
    result = TickResult(started_at=0.0, hosts={"gpu01": None, "gpu02": "unreachable"}, actions=ACTIONS,
                        duration_s=2.25)
    harvest_cmd.show_tick(result, as_json=False)
    out = capsys.readouterr()
    assert "2 host(s) probed, 1 failed, 2.2 s" in out.out and "unreachable" in out.err
    assert [line.strip() for line in out.out.splitlines()[1:]] == [
        "reclaim   gpu01:2 from job 4 in 1.23 s (shrink; deadline 30 s)",
        "reclaim   gpu01:3 from job 4 FAILED (requeue; deadline 30 s)",
        "grow      job 5 onto gpu02:0: workers [3]",
        "grow      job 6 onto gpu02:1: FAILED: spawn failed",
        "place     job 7 started on CPU slots",
        "grow: skipped, over quota",
    ]


def test_a_skipped_tick_and_an_idle_one_say_so(capsys):
    harvest_cmd.show_tick(TickResult(started_at=0.0, skipped="another tick holds the lock"), as_json=False)
    harvest_cmd.show_tick(TickResult(started_at=0.0, hosts={"gpu01": None}), as_json=False)
    out = capsys.readouterr().out
    assert "harvest tick skipped: another tick holds the lock" in out
    assert out.splitlines()[-1].strip() == "nothing to do"


def test_json_lines_are_one_object_per_tick(capsys):
    harvest_cmd.show_tick(TickResult(started_at=5.0, actions=ACTIONS[:1]), as_json=True, lines=True)
    (line,) = capsys.readouterr().out.splitlines()
    assert json.loads(line)["actions"] == ACTIONS[:1]




@pytest.mark.parametrize("args,message", [
    (["report", "--json", "--csv"], "--json and --csv: choose one."),
    (["report", "--by", "team"], "--by 'team': expected host or user."),
    (["watch", "--ticks", "0"], "--ticks 0: must be 1 or more"),
])
def test_bad_options_are_usage_errors(home, config_path, args, message):
    r = invoke(home, config_path, *args)
    assert r.exit_code == 2 and message in r.stderr


def test_an_empty_pools_report_by_user(home, config_path):
    r = invoke(home, config_path, "report", "--by", "user", "--since", "24h")
    assert r.exit_code == 0 and "no GPU or CPU slot time used since" in r.stdout


def test_an_unknown_harvest_policy_exits_2_naming_the_choices(home):
    """Issue 32: `[harvest] policy` is "fair" or "throughput"; anything else is one line, exit 2."""
    from tests.clirun import invoke
    cfg = home / "bad.toml"
    cfg.write_text("[harvest]\npolicy = 'fastest'\n")
    r = invoke(home, cfg, "harvest", "--dry-run")
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert "harvest.policy: Input should be 'fair' or 'throughput', got 'fastest'." in r.output
