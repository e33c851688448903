"""The command line, in-process (typer's CliRunner) and as the installed console script.

Jobs here that must stay queued are submitted while the `busy_slots` fixture's job holds
3 of the host's 4 slots (its workers are a `sleep`): they ask for 2 or more, so they wait
because the pool is busy now. Real training workers are in tests/e2e/test_local_jobs.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpuflex.cli import app
from gpuflex.control import access
from tests.conftest import GpuflexCLI, add_finished_job, db_dump, db_rows, write_config


class Result:
    def __init__(self, code: int, stdout: str, stderr: str) -> None:
        self.code, self.stdout, self.stderr = code, stdout, stderr

    def json(self):
        assert self.code == 0, self.stderr
        return json.loads(self.stdout)


def make_cli(kind: str, home: Path, config_path: Path):
    """cli(*args, env=...) -> Result, in-process or as the console script, with the test's config."""

    def via_runner(*args: str, env: dict[str, str] | None = None) -> Result:
        full = {"HOME": str(home), "GPUFLEX_CONFIG": str(config_path), "COLUMNS": "200", **(env or {})}
        r = CliRunner().invoke(app, list(args), env=full)
        if r.exception is not None and not isinstance(r.exception, SystemExit):
            raise r.exception
        return Result(r.exit_code, r.stdout, r.stderr)

    def via_script(*args: str, env: dict[str, str] | None = None) -> Result:
        g = GpuflexCLI(home, config_path)
        p = g(*args, env=g.env(**(env or {})))
        return Result(p.returncode, p.stdout, p.stderr)

    return via_runner if kind == "clirunner" else via_script


@pytest.fixture(params=["clirunner", "script"])
def cli(request, home, config_path):
    """Both ways: for the basic contract."""
    return make_cli(request.param, home, config_path)


@pytest.fixture
def cli_fast(home, config_path):
    """In-process only: for tests that run many commands (the machine is small and shared)."""
    return make_cli("clirunner", home, config_path)


def test_status_of_an_empty_pool(cli):
    assert cli("status", "--json").json() == []
    table = cli("status")
    assert table.code == 0 and "ID" in table.stdout and "STATE" in table.stdout


def test_hosts_shows_the_configured_slots(cli):
    view = cli("hosts", "--json").json()
    assert [(h["name"], h["address"]) for h in view] == [("local", "local")]
    assert [(d["index"], d["kind"], d["holder"]) for d in view[0]["devices"]] == [
        (i, "slot", None) for i in range(4)]
    text = cli("hosts").stdout
    assert "slot 3" in text and "free" in text


def test_submit_records_a_job_that_waits_for_slots(cli, home, db_path, busy_slots):
    job = cli("submit", "--json", "--name", "big", "--workers", "2:3", "--priority", "3",
              "--env", "A=1", "--env", "B=x=y", "--workdir", str(home), "--",
              "python", "train.py", "--lr", "0.1").json()
    assert job["id"] == 2 and job["name"] == "big" and job["state"] == "queued"
    assert (job["min_workers"], job["max_workers"], job["world_size"], job["generation"]) == (2, 3, 0, 0)
    assert job["argv"] == ["python", "train.py", "--lr", "0.1"]
    assert job["env"] == {"A": "<redacted>", "B": "<redacted>"}   # issue 17: names, never values
    assert db_rows(db_path, "SELECT env FROM jobs WHERE id = 2") == [('{"A": "1", "B": "x=y"}',)]
    assert (job["priority"], job["workdir"], job["workers"]) == (3, str(home), [])
    assert job["queue_reason"] == "waiting for 2 free slots on local (1 free now)"
    assert db_rows(db_path, "SELECT name, state, min_workers, max_workers, priority FROM jobs ORDER BY id") == [
        ("busy", "running", 3, 3, 0), ("big", "queued", 2, 3, 3)]
    assert db_rows(db_path, "SELECT count(*) FROM workers WHERE job_id = 2") == [(0,)]
    events = cli("events", "2", "--json").json()
    assert [e["kind"] for e in events] == ["submitted", "queued"]
    assert events[1]["message"] == job["queue_reason"]


def test_submit_prints_the_id_and_why_it_waits(cli, busy_slots):
    r = cli("submit", "--workers", "2", "--", "python", "x.py")
    assert r.code == 0
    assert r.stdout.strip() == "job 2 (python) queued: waiting for 2 free slots on local (1 free now)"


def test_status_of_one_job_and_of_all(cli_fast, busy_slots):
    cli_fast("submit", "--name", "a", "--workers", "2", "--", "true")
    cli_fast("submit", "--name", "b", "--workers", "3", "--", "true")
    one = cli_fast("status", "3", "--json").json()
    assert (one["id"], one["name"], one["state"]) == (3, "b", "queued")
    assert cli_fast("status", "b", "--json").json()["id"] == 3
    all_jobs = cli_fast("status", "--json").json()
    assert isinstance(all_jobs, list) and [(j["name"], j["state"]) for j in all_jobs] == [
        ("busy", "running"), ("a", "queued"), ("b", "queued")]
    assert all(set(j) >= {"id", "name", "state", "min_workers", "max_workers", "world_size",
                          "generation", "workers"} for j in all_jobs)
    text = cli_fast("status", "a").stdout
    assert "job 2" in text and "queued" in text and "waiting for 2 free slots on local (1 free now)" in text


def test_a_name_refers_to_the_newest_job_of_that_name(cli_fast, busy_slots):
    cli_fast("submit", "--name", "same", "--workers", "2", "--", "true")
    cli_fast("submit", "--name", "same", "--workers", "3", "--", "true")
    assert cli_fast("status", "same", "--json").json()["min_workers"] == 3


def test_cancel_a_queued_job(cli_fast, db_path, busy_slots):
    cli_fast("submit", "--name", "q", "--workers", "2", "--", "true")
    r = cli_fast("cancel", "q")
    assert (r.code, r.stdout.strip()) == (0, "job 2 cancelled")
    st = cli_fast("status", "2", "--json").json()
    assert st["state"] == "cancelled" and st["ended_at"] is not None and st["workers"] == []
    assert cli_fast("events", "2", "--json").json()[-1]["message"] == f"cancelled: cancelled by {access.caller()}"
    assert st["exit_reason"] == f"cancelled by {access.caller()}"   # the owner: no "(admin)"
    assert cli_fast("status", "busy", "--json").json()["state"] == "running"   # only the one named


def test_scale_a_queued_job_is_refused_and_changes_nothing(cli_fast, db_path, busy_slots):
    cli_fast("submit", "--workers", "2:3", "--", "true")
    before = db_dump(db_path)
    r = cli_fast("scale", "2", "3")
    assert r.code == 2 and "only running jobs can be scaled" in r.stderr
    assert db_dump(db_path) == before


def test_config_option_beats_the_environment(cli, home):
    other = home / "other"
    other.mkdir()
    write_config(other, slots=2)
    for flag in ("--config", "-c"):
        view = cli(flag, str(other / "g.toml"), "hosts", "--json").json()
        assert len(view[0]["devices"]) == 2
    assert (other / "g.db").is_file()
    assert len(cli("hosts", "--json").json()[0]["devices"]) == 4


def test_gpuflex_toml_in_the_working_directory_is_found(home):
    write_config(home, slots=3, name="gpuflex.toml")
    g = GpuflexCLI(home, None)
    assert len(g.json("hosts")[0]["devices"]) == 3
    assert (home / "g.db").is_file()


def test_python_dash_m_gpuflex_is_the_same_cli(home, config_path):
    env = GpuflexCLI(home, config_path).env()
    p = subprocess.run([sys.executable, "-m", "gpuflex", "status", "--json"], env=env, cwd=home,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == []


def test_no_arguments_prints_help(home):
    r = CliRunner().invoke(app, [], env={"HOME": str(home)})
    assert "Usage:" in r.output and "submit" in r.output
    assert not Path(home, ".local").exists()


def test_logs_prints_all_of_a_large_log_with_one_prefix_per_line(cli_fast, home, config_path):
    # more than one read's worth (1 MiB), with lines that straddle the read boundary
    big = [f"w0 line {i} " + "x" * (i % 97) for i in range(25000)]
    (home / "w0.log").write_text("\n".join(big) + "\n")
    (home / "w1.log").write_text("a\nb")  # the last line has no newline
    job_id = add_finished_job(config_path, "big-log", [home / "w0.log", home / "w1.log"])
    assert (home / "w0.log").stat().st_size > 1 << 20

    one = cli_fast("logs", str(job_id), "--worker", "0")
    assert one.code == 0
    assert one.stdout == (home / "w0.log").read_text()

    both = cli_fast("logs", "big-log").stdout.splitlines()
    assert both == [f"[w0] {line}" for line in big] + ["[w1] a", "[w1] b"]


def test_a_host_python_that_cannot_run_is_reported_not_a_traceback(home):
    bad_python = home / "notexec"
    bad_python.write_text("#!/bin/sh\n")  # not executable: exec fails with EACCES, even for root
    cfg = write_config(home, extra=f'python = "{bad_python}"\n')
    r = make_cli("clirunner", home, cfg)("submit", "--", "true")
    assert r.code in (0, 1)  # recorded (and waiting or failed), or the operation failed
    assert f"cannot run {bad_python}: Permission denied" in r.stdout + r.stderr


@pytest.mark.parametrize("interval, n", [("0.2", 2), ("3600", 1)], ids=["refreshes", "ctrl-c-in-the-sleep"])
def test_status_watch_json_streams_one_document_per_refresh_until_ctrl_c(home, config_path, busy_slots,
                                                                        interval, n):
    """With an hour between refreshes, only a signal that ends the sleep lets it exit in time."""
    import signal

    g = GpuflexCLI(home, config_path)
    g.ok("submit", "--name", "w", "--workers", "2", "--", "true")
    p = subprocess.Popen([g.script, "status", "w", "--json", "--watch", "--interval", interval],
                         env=g.env(), cwd=home, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        docs = [json.loads(p.stdout.readline()) for _ in range(n)]
    finally:
        p.send_signal(signal.SIGINT)
        rest, err = p.communicate(timeout=60)
    assert [(d["id"], d["name"], d["state"]) for d in docs] == [(2, "w", "queued")] * n
    assert all(json.loads(line)["state"] == "queued" for line in rest.splitlines())
    assert p.returncode == 0 and err == ""


def test_a_signal_during_the_work_waits_for_it_and_a_second_one_aborts_it(capsys):
    """StopSignals in this process: the first SIGINT between sleeps only marks the stop
    (no KeyboardInterrupt inside the work), the next sleep returns at once, and a second
    SIGINT during the work raises KeyboardInterrupt."""
    import os
    import signal

    from gpuflex.cli.common import StopSignals

    before = signal.getsignal(signal.SIGINT)
    with StopSignals(notice="stopping after this tick") as stop:
        os.kill(os.getpid(), signal.SIGINT)   # "during the work": no exception here
        marked = sum(range(1000))             # bytecodes for the handler to run between
        assert stop.requested and marked
        assert "stopping after this tick" in capsys.readouterr().err
        assert stop.sleep(3600) is True       # returns without sleeping
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            sum(range(1000))
    assert signal.getsignal(signal.SIGINT) is before


def test_user_text_that_looks_like_markup_is_printed_as_itself(gf):
    """A command or message with rich markup in it ("[/x]" closes no tag) once made every
    later status and events crash with a MarkupError, for every user of the pool."""
    p = gf("submit", "--json", "--", "[/x]", "[red]arg")
    assert "Traceback" not in p.stdout + p.stderr, p.stderr
    job = str(json.loads(p.stdout)["id"])
    assert "x]" in gf.ok("status").stdout                        # the name: the command's base name
    one = gf.ok("status", job).stdout
    assert "[/x]" in one, one                                     # in the launch failure's reason
    assert "[/x]" in gf.ok("events", job).stdout


def test_watch_refreshes_the_jobs_between_its_ticks(home, config_path, db_path, busy_slots):
    """`watch --interval 1d --refresh 0.3`: after its first tick (job 2 queued behind the busy
    job), the busy job's workers are killed and no other command runs; only the refresh
    between ticks can notice it ended and start job 2 in its slots."""
    import os
    import signal
    import time

    g = GpuflexCLI(home, config_path)
    queued = json.loads(g.ok("submit", "--json", "--name", "w", "--workers", "2", "--", "sleep", "600").stdout)
    assert queued["state"] == "queued"
    p = subprocess.Popen([g.script, "watch", "--interval", "1d", "--refresh", "0.3", "--json"],
                         env=g.env(), cwd=home, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = json.loads(p.stdout.readline())   # the first tick is done: job 2 still waits
        assert first["skipped"] is None
        assert db_rows(db_path, "SELECT state FROM jobs WHERE id = 2") == [("queued",)]
        for w in busy_slots["workers"]:
            os.killpg(os.getpgid(w["pid"]), signal.SIGKILL)
        end = time.monotonic() + 60   # a guard against a hang, not a timing
        while db_rows(db_path, "SELECT state FROM jobs WHERE id = 2") == [("queued",)] and time.monotonic() < end:
            time.sleep(0.2)
        states = dict(db_rows(db_path, "SELECT id, state FROM jobs"))
    finally:
        p.send_signal(signal.SIGINT)
        rest, err = p.communicate(timeout=60)
    assert states == {1: "failed", 2: "running"}, (states, err)
    assert p.returncode == 0 and rest == "" and "stopped after 1 tick(s)" in err, (rest, err)


@pytest.mark.parametrize("value, fragment", [("-1", "expected a duration above 0"), ("soon", "'soon'"),
                                             ("2d", "give seconds from 0 to 86400")])
def test_watch_refresh_bad_input_exits_2(cli_fast, value, fragment):
    r = cli_fast("watch", "--refresh", value, "--ticks", "1")
    assert r.code == 2 and fragment in r.stdout + r.stderr, (r.stdout, r.stderr)
