"""Bad input: exit code 2, one clear line on stderr, no traceback, and nothing changed.

Each case runs twice: in-process through typer's CliRunner and through the installed
console script, against a DB that already holds a finished job (or, for config and
database errors, where no DB may appear at all).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpuflex.cli import app
from gpuflex.control import access
from gpuflex.config import load_config
from gpuflex.control.service import JobService
from gpuflex.db.models import Event, Job, Worker
from tests.conftest import GpuflexCLI, db_dump, write_config


def make_run(kind: str, home: Path):
    """run(config, *args) -> (exit code, stdout, stderr), the CLI one way or the other."""

    def via_runner(config: Path, *args: str):
        env = {"HOME": str(home), "GPUFLEX_CONFIG": str(config), "COLUMNS": "200"}
        r = CliRunner().invoke(app, list(args), env=env)
        if r.exception is not None and not isinstance(r.exception, SystemExit):
            raise r.exception  # would have been a traceback for a user
        return r.exit_code, r.stdout, r.stderr

    def via_script(config: Path, *args: str):
        p = GpuflexCLI(home, config)(*args)
        return p.returncode, p.stdout, p.stderr

    return via_runner if kind == "clirunner" else via_script


@pytest.fixture(params=["clirunner", "script"])
def run(request, home):
    """Both ways, for the cases the contract lists."""
    return make_run(request.param, home)


@pytest.fixture
def run_fast(home):
    """In-process only, for further cases (the machine is small and shared)."""
    return make_run("clirunner", home)


@pytest.fixture
def seeded(config_path, db_path) -> Path:
    """A DB at head with the host mirrored and one succeeded job of the caller's (id 1, name 'done')."""
    svc = JobService(load_config(str(config_path)))
    svc.refresh()
    with svc.sessions.begin() as s:
        job = Job(token="abc123", name="done", state="succeeded", argv=["true"], workdir=str(db_path.parent),
                  env={}, min_workers=1, max_workers=2, elastic="inplace", gpus_per_worker=1, user=access.caller(), world_size=1,
                  exit_code=0, exit_reason="all workers exited 0", started_at=time.time(),
                  ended_at=time.time())
        job.workers.append(Worker(wid=0, rank=0, host="local", gpus=[0], state="exited", exit_code=0,
                                  log_path=str(db_path.parent / "w0.log"),
                                  exit_path=str(db_path.parent / "w0.exit")))
        job.events.append(Event(kind="state", message="succeeded: all workers exited 0"))
        s.add(job)
    svc.close()
    assert len(db_dump(db_path)["jobs"]) == 1
    return config_path


def assert_rejected(result, *fragments: str) -> str:
    code, out, err = result
    text = out + err
    assert "Traceback" not in text
    assert code == 2, text
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got: {err!r}"
    assert lines[0].startswith("error: ")
    for f in fragments:
        assert f in lines[0], f"{f!r} not in {lines[0]!r}"
    return lines[0]


def check_unchanged(run, seeded, db_path, args, *fragments) -> str:
    before = db_dump(db_path)
    line = assert_rejected(run(seeded, *args), *fragments)
    assert db_dump(db_path) == before
    return line


# ---- submit --------------------------------------------------------------------------------
def test_workers_max_below_min(run, seeded, db_path):
    check_unchanged(run, seeded, db_path, ["submit", "--workers", "3:1", "--", "true"],
                    "'3:1'", "MAX (1) is below MIN (3)", "MIN:MAX")


def test_workers_zero(run, seeded, db_path):
    check_unchanged(run, seeded, db_path, ["submit", "--workers", "0", "--", "true"],
                    "'0'", "at least 1 worker")


def test_workers_not_a_number(run, seeded, db_path):
    check_unchanged(run, seeded, db_path, ["submit", "--workers", "x", "--", "true"],
                    "'x'", "not N or MIN:MAX", "e.g. 2 or 1:4")


def test_workers_value_is_shown_verbatim_not_as_markup(run, seeded, db_path):
    check_unchanged(run, seeded, db_path, ["submit", "--workers", "[red]2", "--", "true"],
                    "'[red]2'")


@pytest.mark.parametrize("args", [["submit"], ["submit", "--"], ["submit", "--", ""],
                                  ["submit", "--workers", "2", "--", "  "]],
                         ids=["nothing", "bare-dashes", "empty-string", "blank"])
def test_empty_command(run, seeded, db_path, args):
    check_unchanged(run, seeded, db_path, args, "no command to run", "after '--'")


def test_env_without_equals(run, seeded, db_path):
    check_unchanged(run, seeded, db_path, ["submit", "--env", "FOO", "--", "true"],
                    "'FOO'", "no '='", "KEY=VALUE")


def test_env_with_a_bad_name(run_fast, seeded, db_path):
    check_unchanged(run_fast, seeded, db_path, ["submit", "--env", "1X=2", "--", "true"],
                    "'1X'", "not a valid variable name")


def test_negative_gpus_per_worker(run, seeded, db_path):
    check_unchanged(run, seeded, db_path, ["submit", "--gpus-per-worker", "-1", "--", "true"],
                    "--gpus-per-worker -1", "at least 1 GPU")


def test_zero_gpus_per_worker_is_refused_as_it_would_bypass_placement(run_fast, seeded, db_path):
    check_unchanged(run_fast, seeded, db_path, ["submit", "--gpus-per-worker", "0", "--", "true"],
                    "--gpus-per-worker 0", "at least 1 GPU (or CPU slot)")


@pytest.mark.parametrize("args,most", [(["--workers", "5"], 4), (["--workers", "5:8"], 4),
                                       (["--workers", "3", "--gpus-per-worker", "2"], 2)],
                         ids=["5-on-4-slots", "min-5", "3x2-on-4-slots"])
def test_a_job_the_pool_can_never_hold_is_refused(run, seeded, db_path, args, most):
    """The pool is one host with 4 CPU slots (conftest.write_config)."""
    check_unchanged(run, seeded, db_path, ["submit", *args, "--", "true"],
                    "can never start", f"at most {most} such worker(s)", "local: 4 slots", "lower MIN")


def test_the_pool_counted_is_the_configured_one_reachable_or_not(run_fast, seeded, db_path, home):
    two = home / "two.toml"
    two.write_text(
        f'[database]\nurl = "sqlite:///{db_path}"\n'
        f'[[hosts]]\nname = "local"\ngpus = "cpu:4"\nworkdir = "{home}/work"\n'
        f'[[hosts]]\nname = "box"\naddress = "10.255.255.1"\ngpus = [0, 1]\nconnect_timeout_s = 0.2\n')
    # 4 slots + 2 GPUs: 6 one-device workers at most, on hosts that are not all reachable
    code, out, err = run_fast(two, "submit", "--workers", "6", "--", "true")
    assert code == 0 and "queued" in out, out + err
    assert_rejected(run_fast(two, "submit", "--workers", "7", "--", "true"),
                    "at most 6 such worker(s)", "local: 4 slots, box: 2 GPUs")


def test_missing_workdir(run_fast, seeded, db_path, home):
    check_unchanged(run_fast, seeded, db_path, ["submit", "--workdir", str(home / "nope"), "--", "true"],
                    str(home / "nope"), "not a directory")


def test_bad_job_name(run_fast, seeded, db_path):
    check_unchanged(run_fast, seeded, db_path, ["submit", "--name", "a b", "--", "true"], "'a b'")


@pytest.mark.parametrize("name", ["1", "007"])
def test_a_name_of_digits_only_is_refused_since_it_would_read_as_a_job_id(run_fast, seeded, db_path, name):
    check_unchanged(run_fast, seeded, db_path, ["submit", "--name", name, "--", "true"], repr(name), "job id")


@pytest.mark.parametrize("args", [["submit", "--bogus", "1", "--", "true"], ["submit", "--wokers", "2", "--", "true"],
                                  ["submit", "-q", "true"]], ids=["bogus", "typo", "short"])
def test_an_unknown_submit_option_is_refused_not_run_as_the_command(run_fast, seeded, db_path, args):
    check_unchanged(run_fast, seeded, db_path, args, f"no such option '{args[1]}'", "before '--'")


# ---- unknown jobs ------------------------------------------------------------------------------
@pytest.mark.parametrize("args", [["status", "99"], ["status", "99", "--json"], ["status", "nosuchjob"],
                                  ["cancel", "99"], ["logs", "99"], ["events", "99"],
                                  ["scale", "99", "2"]],
                         ids=["status", "status-json", "status-by-name", "cancel", "logs", "events", "scale"])
def test_unknown_job(run, seeded, db_path, args):
    check_unchanged(run, seeded, db_path, args, f"no job '{args[1]}'", "gpuflex status")


def test_unknown_job_on_an_empty_db_leaves_it_empty(run_fast, config_path, db_path):
    GpuflexCLI(db_path.parent, config_path).ok("db", "upgrade")
    check_unchanged(run_fast, config_path, db_path, ["logs", "7"], "no job '7'")
    assert db_dump(db_path)["hosts"] == []


def test_cancel_a_finished_job(run_fast, seeded, db_path):
    check_unchanged(run_fast, seeded, db_path, ["cancel", "1"], "already succeeded")


def test_scale_a_finished_job(run_fast, seeded, db_path):
    check_unchanged(run_fast, seeded, db_path, ["scale", "done", "2"], "only running jobs can be scaled")


def test_logs_of_a_missing_worker(run_fast, seeded, db_path):
    check_unchanged(run_fast, seeded, db_path, ["logs", "1", "--worker", "5"], "no worker with rank or id 5")


# ---- config and database -------------------------------------------------------------------------
def _config(home: Path, text: str) -> Path:
    f = home / "bad.toml"
    f.write_text(f'[database]\nurl = "sqlite:///{home}/g.db"\n' + text)
    return f


def _no_db(home: Path) -> None:
    assert not (home / "g.db").exists()
    assert not list(home.glob("g.db*"))


def test_unknown_config_key(run, home):
    f = _config(home, "[jobs]\ncancel_grace=3\n")
    assert_rejected(run(f, "status"), str(f), "jobs.cancel_grace", "unknown key", "cancel_grace_s")
    _no_db(home)


def test_config_value_of_the_wrong_type(run, home):
    f = _config(home, '[[hosts]]\nname = "local"\ngpus = "cpu:4"\nport = "22"\n')
    assert_rejected(run(f, "submit", "--", "true"), str(f), "hosts[0].port", "expected int", "'22'")
    _no_db(home)


def test_toml_syntax_error(run, home):
    f = _config(home, "[jobs\ncancel_grace_s = 3\n")
    assert_rejected(run(f, "status"), str(f), "TOML syntax error", "line 3", "column")
    _no_db(home)


def test_missing_config_file(run, home):
    assert_rejected(run(home / "absent.toml", "status"), str(home / "absent.toml"), "file not found")
    _no_db(home)


def test_unwritable_database_path(run, home):
    (home / "afile").write_text("keep me")
    f = home / "c.toml"
    f.write_text(f'[database]\nurl = "sqlite:///{home}/afile/g.db"\n')
    assert_rejected(run(f, "submit", "--", "true"), str(home / "afile"), "[database] url")
    assert (home / "afile").read_text() == "keep me"
    assert sorted(p.name for p in home.iterdir()) == ["afile", "c.toml"]


def test_database_file_that_is_not_sqlite(run, home):
    (home / "junk.db").write_text("junk\n" * 100)
    f = home / "c.toml"
    f.write_text(f'[database]\nurl = "sqlite:///{home}/junk.db"\n')
    assert_rejected(run(f, "status"), "not a database", "[database] url")
    assert (home / "junk.db").read_text() == "junk\n" * 100


def test_database_url_with_an_unknown_dialect(run_fast, home):
    f = home / "c.toml"
    f.write_text('[database]\nurl = "nosuch://host/db"\n')
    assert_rejected(run_fast(f, "status"), "nosuch", "[database] url")


def test_bad_config_through_the_environment_is_the_same_error(home):
    f = write_config(home, extra="colour = 1\n")
    p = GpuflexCLI(home, f)("hosts")
    assert_rejected((p.returncode, p.stdout, p.stderr), str(f), "hosts[0].colour", "unknown key")
    _no_db(home)


# ---- issue 16: values past what the database or time_t holds, and text it cannot store -------------
BIG = "1" + "0" * 25   # 10^25: past SQLite's 64-bit and PostgreSQL's 32-bit INTEGER


@pytest.mark.parametrize("args,fragment", [
    (["submit", "--workers", BIG, "--", "true"], "at most 65536 workers"),
    (["submit", "--workers", f"1:{BIG}", "--", "true"], "at most 65536 workers"),
    (["submit", "--priority", BIG, "--", "true"], "--priority 1000"),
    (["submit", "--priority", "-2147483648", "--", "true"], "from -2147483647 to 2147483647"),
    (["submit", "--gpus-per-worker", BIG, "--", "true"], "from 1 to 4096"),
    (["status", BIG], "job ids go from 1 to 2147483647"),
    (["cancel", "2147483648"], "job ids go from 1 to 2147483647"),
    (["scale", "1", BIG], "N 1000"),
], ids=["workers", "workers-max", "priority", "priority-low", "gpus-per-worker", "status-id", "cancel-id",
        "scale-n"])
def test_integers_too_large_for_the_database_are_refused_with_their_bounds(run, seeded, db_path, args, fragment):
    check_unchanged(run, seeded, db_path, args, fragment)


@pytest.mark.parametrize("ref", ["²", "٣", "１２"])
def test_unicode_digits_are_not_a_job_id(run_fast, seeded, db_path, ref):
    check_unchanged(run_fast, seeded, db_path, ["status", ref], f"no job {ref!r}")


@pytest.mark.parametrize("args,fragment", [
    (["status", "1", "--watch", "--interval", "1e10"], "--interval 10000000000.0: give seconds from 0.2 to 86400"),
    (["status", "--watch", "--interval", "nan"], "--interval nan"),
    (["status", "--watch", "--interval", "inf"], "--interval inf"),
    (["watch", "--interval", "9999999999999d"], "give seconds from 0 to 86400"),
    (["watch", "--ticks", BIG], "at most 1000000"),
    (["scale", "1", "2", "--wait", "--timeout", "1e300"], "--timeout 1e+300"),
    (["report", "--since", "9999999999999d"], "reaches back before 1970-01-01"),
    (["report", "--since", "0001-01-01"], "reaches back before 1970-01-01"),
], ids=["status-watch", "status-nan", "status-inf", "watch", "ticks", "scale-timeout", "since-duration",
        "since-date"])
def test_times_past_what_time_t_holds_are_refused(run, seeded, db_path, args, fragment):
    check_unchanged(run, seeded, db_path, args, fragment)


@pytest.mark.parametrize("args,fragment", [
    (["submit", "--", "\udcff"], "not UTF-8"),
    (["submit", "--", "python", "caf\udce9.py"], "the command's argument 1"),
    (["submit", "--workdir", "/tmp/\udcff", "--", "true"], "--workdir"),
    (["submit", "--env", "A=\udcff", "--", "true"], "--env A=... holds bytes that are not UTF-8"),
    (["status", "\udcff"], "no job"),
], ids=["program", "argument", "workdir", "env", "job-ref"])
def test_bytes_that_are_not_utf8_are_refused_not_a_traceback(run, seeded, db_path, args, fragment):
    """The shell hands them over as surrogate escapes; the console script gets real bytes."""
    line = check_unchanged(run, seeded, db_path, args, fragment)
    assert "--env" in args or "\\udc" in line or "\\x" in line   # shown escaped, not written raw


def test_an_env_value_is_never_shown_even_when_refused(run_fast, seeded, db_path):
    line = check_unchanged(run_fast, seeded, db_path, ["submit", "--env", "TOKEN=s3cr\udcffet", "--", "true"],
                           "--env TOKEN=...")
    assert "s3cr" not in line


def test_a_rejected_priority_creates_no_database(run, config_path, db_path):
    assert_rejected(run(config_path, "submit", "--priority", "x", "--", "true"), "--priority",
                    "valid integer")
    assert not db_path.exists() and not list(db_path.parent.glob("g.db*"))


def test_a_rejected_priority_leaves_the_database_unchanged(run, seeded, db_path):
    check_unchanged(run, seeded, db_path, ["submit", "--priority", "x", "--", "true"], "--priority")


# ---- the parser's own errors: one line too ------------------------------------------------------------
@pytest.mark.parametrize("args,fragments", [
    (["status", "--bogus"], ("No such option", "--bogus", "gpuflex status --help")),
    (["logs"], ("Missing argument", "'job'", "gpuflex logs --help")),
    (["logs", "1", "--worker", "x"], ("--worker", "valid integer")),
    (["stauts"], ("No such command", "stauts", "status")),
    (["--bogus", "status"], ("No such option", "--bogus")),
    (["db", "upgrade", "now"], ("unexpected extra argument", "now")),
    (["status", "--json=1"], ("does not take a value",)),
    (["status", "--interval"], ("requires an argument",)),
], ids=["unknown-option", "missing-argument", "bad-int", "unknown-command", "root-option", "extra-argument",
        "flag-value", "no-value"])
def test_parser_errors_are_one_error_line_with_exit_2(run, seeded, db_path, args, fragments):
    line = check_unchanged(run, seeded, db_path, args, *fragments)
    assert "╭" not in line and "Usage:" not in line


def test_help_is_still_the_full_help(run_fast, seeded):
    code, out, err = run_fast(seeded, "submit", "--help")
    assert code == 0 and "Usage:" in out and "--gpus-per-worker" in out and err == ""


def test_a_group_given_no_command_prints_its_help_not_an_error(run_fast, seeded):
    code, out, err = run_fast(seeded, "db")
    assert "Usage: gpuflex db" in out and "upgrade" in out and err == ""


# ---- config: every number bounded, no empty paths or commands ----------------------------------------
@pytest.mark.parametrize("table,key,value,fragment", [
    ("jobs", "cancel_grace_s", "1e10", "must be <= 3600"),
    ("jobs", "pg_timeout_s", "1e10", "must be <= 3600"),
    ("jobs", "heartbeat_timeout_s", "1e10", "must be <= 3600"),
    ("jobs", "checkpoint_interval_s", "1e10", "must be <= 86400"),
    ("harvest", "interval_s", "1e10", "must be <= 86400"),
    ("harvest", "reclaim_deadline_s", "1e10", "must be <= 3600"),
    ("harvest", "idle_util_pct", "101", "must be <= 100"),
], ids=lambda v: v if isinstance(v, str) and v.isidentifier() else None)
def test_config_numbers_past_their_bound_are_refused_before_any_command(run, home, table, key, value, fragment):
    f = _config(home, f"[{table}]\n{key} = {value}\n")
    assert_rejected(run(f, "cancel", "1"), str(f), f"{table}.{key}", fragment)
    _no_db(home)


@pytest.mark.parametrize("key", ["workdir", "python", "address", "nvidia_smi", "known_hosts", "owner"])
@pytest.mark.parametrize("value", ["", "  "], ids=["empty", "blank"])
def test_empty_host_strings_are_refused_before_the_database_exists(run_fast, home, key, value):
    f = _config(home, f'[[hosts]]\nname = "local"\ngpus = "cpu:2"\n{key} = "{value}"\n')
    assert_rejected(run_fast(f, "submit", "--", "true"), str(f), f"hosts[0].{key}", "must not be empty")
    _no_db(home)
    assert sorted(p.name for p in home.iterdir()) == ["bad.toml"]


# ---- issue 11: time limits, dependencies, arrays, elastic modes ----------------------------
@pytest.mark.parametrize("args,fragments", [
    (["--time", "0"], ["--time '0'", "more than 0"]),
    (["--time", "5x"], ["--time '5x' is not a time", "1-12:00:00"]),
    (["--after", "999"], ["--after 999: there is no job 999"]),
    (["--after", "1,x"], ["--after '1,x'", "job ids separated by commas"]),
    (["--array", "5-1"], ["--array '5-1'", "goes down", "write 1-5"]),
    (["--array", "0-3%0"], ["--array '0-3%0'", "at least 1"]),
    (["--array", "1,1"], ["names an index twice"]),
    (["--elastic", "restart", "--workers", "4:4"], ["--elastic restart with --workers 4:4", "--workers 1:4"]),
    (["--elastic", "sideways"], ["--elastic 'sideways'"]),
    (["--retries", "-1"], ["--retries -1", "from 0 to"]),
], ids=["time-0", "time-5x", "after-unknown", "after-not-ids", "array-down", "array-cap-0", "array-twice",
        "restart-fixed", "elastic-unknown", "retries-negative"])
def test_issue_11_options_refuse_bad_values_with_one_line_and_no_change(run_fast, seeded, db_path, args, fragments):
    check_unchanged(run_fast, seeded, db_path, ["submit", *args, "--", "true"], *fragments)


@pytest.mark.parametrize("args,fragment", [
    (["status", "1_99999999999"], "job ids go from 1"),
    (["cancel", "7_0"], "no job '7_0'"),
    (["submit", "--name", "5_3", "--", "true"], "ID_INDEX"),
], ids=["status-array-ref", "cancel-unknown-array-ref", "name-like-an-array-ref"])
def test_array_references_are_checked_like_job_ids(run_fast, seeded, db_path, args, fragment):
    check_unchanged(run_fast, seeded, db_path, args, fragment)
