"""`gpuflex submit SCRIPT` and `gpuflex submit TASK.toml` in process (issue 33, job scripts):
the settings each layer gives, which wins, where each came from (`status`), the warning for
what is ignored, and bad input refused with one line and nothing recorded.

Every job here waits for job 1 (`--after 1`), which asks for more slots than the test's
host holds: nothing is ever started, no process."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from gpuflex.cli.job_settings import sources_text
from gpuflex.config import load_config
from gpuflex.control.service import JobService
from gpuflex.db.models import Job
from tests import clirun
from tests.conftest import db_dump, db_rows


@pytest.fixture
def waiting(home, config_path) -> Path:
    """Job 1, queued for ever (8 workers of 4 slots); returns the home."""
    svc = JobService(load_config(str(config_path)))
    try:
        svc.refresh()
        with svc.sessions.begin() as s:
            s.add(Job(token="never", name="never", state="queued", argv=["true"], workdir=str(home), env={},
                      min_workers=8, max_workers=8, gpus_per_worker=1, user="u", created_at=time.time()))
    finally:
        svc.close()
    return home


def gpuflex(home, config_path, *args):
    return clirun.invoke(home, config_path, *args)


def submitted(home, config_path, *args) -> dict:
    r = gpuflex(home, config_path, "submit", "--json", *args)
    assert r.exit_code == 0, r.stdout + r.stderr
    return json.loads(r.stdout)


def script(home: Path, name: str, text: str, mode: int = 0o755) -> Path:
    path = home / name
    path.write_text(text)
    path.chmod(mode)
    return path


TRAIN = """#!/bin/bash
# train an MLP
#SBATCH --job-name=mlp
#SBATCH --time=00:30:00 --ntasks=2 --gpus-per-task=1
#SBATCH --mem=4G
#SBATCH --partition gpu --dependency=afterok:1
#SBATCH --export=ALL,LR=3e-4
#GPUFLEX --workers 1:2 --priority 3
#GPUFLEX -e SEED=1

python train.py
#SBATCH --time=9
"""


def test_a_script_brings_its_directives_and_the_command_line_overrides_them(waiting, config_path):
    script(waiting, "train.sh", TRAIN)
    r = gpuflex(waiting, config_path, "submit", "--json", "--priority", "5", "-e", "LR=1", "train.sh")
    assert r.exit_code == 0, r.stdout + r.stderr
    job = json.loads(r.stdout)
    assert (job["name"], job["min_workers"], job["max_workers"], job["gpus_per_worker"]) == ("mlp", 1, 2, 1)
    assert (job["time_limit_s"], job["after"], job["priority"], job["state"]) == (1800, [1], 5, "queued")
    assert job["argv"] == ["./train.sh"] and sorted(job["env"]) == ["LR", "SEED"]
    # every submit option has a source; those not given are at their default
    assert {k: v for k, v in job["sources"].items() if v != "default"} == {
        "name": "#SBATCH", "workers": "#GPUFLEX", "gpus_per_worker": "#SBATCH", "priority": "command line",
        "env": "#SBATCH, #GPUFLEX, command line", "time": "#SBATCH", "after": "#SBATCH"}
    assert {"harvest", "workdir", "retries", "array", "requeue", "resume_from"} < set(job["sources"])
    # the command line's LR won over #SBATCH --export's
    env = json.loads(db_rows(waiting / "g.db", "SELECT env FROM jobs WHERE id = ?", (job["id"],))[0][0])
    assert env == {"LR": "1", "SEED": "1"}
    assert r.stderr.strip().splitlines() == ["warning: train.sh: ignored: --mem=4G (line 5), --partition=gpu "
                                             "(line 6), #SBATCH --time=9 (line 12, after the first command)"]


def test_status_shows_where_each_setting_came_from(waiting, config_path):
    script(waiting, "train.sh", TRAIN)
    job = submitted(waiting, config_path, "train.sh")
    r = gpuflex(waiting, config_path, "status", str(job["id"]))
    assert "settings: name from #SBATCH, workers from #GPUFLEX, gpus_per_worker from #SBATCH, priority from " \
           "#GPUFLEX, env from #SBATCH, #GPUFLEX, time from #SBATCH, after from #SBATCH; the rest default" \
           in r.stdout
    assert sources_text({"name": "default"}) == ""


def test_a_task_file_gives_the_settings_and_the_command(waiting, config_path):
    (waiting / "task.toml").write_text('[job]\nworkers = "2"\nafter = [1]\ntime = "2h"\nharvest = true\n'
                                       'env = { LR = "3e-4" }\nrun = "python train.py --lr 3e-4"\n')
    job = submitted(waiting, config_path, "--workers", "1:3", "task.toml")
    assert job["argv"] == ["python", "train.py", "--lr", "3e-4"] and job["name"] == "task"
    assert (job["min_workers"], job["max_workers"], job["time_limit_s"], job["harvest"]) == (1, 3, 7200, True)
    assert job["sources"]["workers"] == "command line" and job["sources"]["time"] == "task file"
    assert job["sources"]["env"] == "task file" and job["sources"]["name"] == "default"


def test_sbatch_export_none_records_none_of_the_submitters_environment(waiting, config_path, monkeypatch):
    monkeypatch.setenv("KEPT_ONLY_IF_ASKED", "yes")
    script(waiting, "bare.sh", "#!/bin/sh\n#SBATCH --export=NONE,A=1 --dependency=afterok:1\ntrue\n")
    job = submitted(waiting, config_path, "bare.sh")
    env = db_rows(waiting / "g.db", "SELECT submit_env FROM jobs WHERE id = ?", (job["id"],))[0][0]
    assert json.loads(env) == {"A": "1"}
    script(waiting, "all.sh", "#!/bin/sh\n#SBATCH --dependency=afterok:1\ntrue\n")
    job = submitted(waiting, config_path, "all.sh")
    env = db_rows(waiting / "g.db", "SELECT submit_env FROM jobs WHERE id = ?", (job["id"],))[0][0]
    assert json.loads(env)["KEPT_ONLY_IF_ASKED"] == "yes"


def test_a_script_that_is_not_executable_runs_through_its_interpreter(waiting, config_path):
    script(waiting, "plain.sh", "#!/usr/bin/env bash\n#GPUFLEX --after 1\ntrue\n", mode=0o644)
    job = submitted(waiting, config_path, "plain.sh", "arg")
    assert job["argv"] == ["/usr/bin/env", "bash", "./plain.sh", "arg"] and job["name"] == "plain.sh"


def test_a_command_on_path_is_not_read_as_a_script(waiting, config_path):
    script(waiting, "true", "#GPUFLEX --bogus\n")   # a file named like a program: the program runs
    job = submitted(waiting, config_path, "--after", "1", "--", "true")
    assert job["argv"] == ["true"] and job["sources"]["after"] == "command line"


@pytest.mark.parametrize("name,text,message", [
    ("bad1.sh", "#!/bin/sh\n#GPUFLEX --bogus 3\ntrue\n", "bad1.sh line 2: no such option '--bogus' for submit."),
    ("bad2.sh", "#!/bin/sh\n#SBATCH --time=1:xx\ntrue\n", "bad2.sh line 2: #SBATCH --time=1:xx: --time '1:xx' is "
                                                          "not a time"),
    ("bad3.sh", "#!/bin/sh\n#GPUFLEX --priority x\n", "bad3.sh line 2: --priority x: Invalid value for "
                                                       "'--priority'"),
    ("bad4.sh", "#GPUFLEX --workers 2 python\n", "bad4.sh line 1: 'python' is not an option"),
    ("bad5.sh", "#GPUFLEX --json\n", "bad5.sh line 1: --json is not a job setting"),
    ("bad6.sh", "#GPUFLEX --workers 0\n", "bad6.sh line 1: --workers '0': at least 1 worker"),
    ("bad7.sh", "#SBATCH --dependency=afterok:99\n", "bad7.sh line 1: #SBATCH --dependency=afterok:99: --after 99: "
                                                       "there is no job 99."),
    ("bad8.sh", "#GPUFLEX --workers 5\n", "bad8.sh line 1: --workers 5:5 with --gpus-per-worker 1 can never start"),
    ("t1.toml", '[job]\nbogus = 1\nrun = "true"\n', "t1.toml: [job] bogus: unknown key"),
    ("t2.toml", "[job]\nworkers =\n", "t2.toml: not TOML"),
    ("t3.toml", '[job]\ntime = "soon"\nrun = "true"\n', "t3.toml [job] time: --time 'soon' is not a time"),
    ("none.toml", None, "none.toml: no such task file."),
])
def test_bad_input_is_one_line_exit_2_and_nothing_recorded(waiting, config_path, name, text, message):
    if text is not None:
        script(waiting, name, text)
    before = db_dump(waiting / "g.db")
    r = gpuflex(waiting, config_path, "submit", name)
    assert r.exit_code == 2, r.stdout + r.stderr
    assert r.stderr.count("\n") == 1 and message in r.stderr and "Traceback" not in r.stderr
    assert db_dump(waiting / "g.db") == before


def test_submits_help_shows_a_script_with_directives(home, config_path):
    out = gpuflex(home, config_path, "submit", "--help").stdout
    assert "#GPUFLEX --workers 1:4" in out and "#SBATCH --job-name=mlp --time=2:00:00" in out
