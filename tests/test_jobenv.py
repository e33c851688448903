"""gpuflex/jobenv.py: what --python, --venv, --conda and --env-setup make of a worker's
command and environment, and of a host's preparation (pure; no process)."""

from __future__ import annotations

import os

import pytest

from gpuflex.errors import UsageError
from gpuflex.jobenv import JobEnv, check_command, check_local, describe, environment, setup_request, worker_argv


def test_python_replaces_a_python_or_python3_first_word_only():
    env = JobEnv(python="/opt/py/bin/python3.11")
    assert worker_argv(env, ["python", "train.py", "python"]) == ["/opt/py/bin/python3.11", "train.py", "python"]
    assert worker_argv(env, ["python3", "-m", "x"]) == ["/opt/py/bin/python3.11", "-m", "x"]
    with pytest.raises(UsageError, match="starts with 'torchrun'. Use --venv"):
        check_command(env, ["torchrun", "train.py"])
    check_command(env, ["python3", "x.py"])   # no error


def test_conda_runs_the_command_through_conda_run_without_capturing_its_output():
    assert worker_argv(JobEnv(conda="torch2"), ["python", "train.py"]) == \
        ["conda", "run", "-n", "torch2", "--no-capture-output", "python", "train.py"]


def test_venv_activates_as_activate_does_and_leaves_the_command_alone():
    env = JobEnv(venv="/envs/a")
    assert worker_argv(env, ["python", "x.py"]) == ["python", "x.py"]
    got = environment(env, {"PATH": "/usr/bin:/bin", "PYTHONHOME": "/elsewhere", "LR": "3"})
    assert got == {"PATH": "/envs/a/bin:/usr/bin:/bin", "VIRTUAL_ENV": "/envs/a", "LR": "3"}
    assert environment(env, {})["PATH"] == "/envs/a/bin"   # --export=NONE: no PATH to keep
    assert environment(JobEnv(), {"PATH": "/bin"}) == {"PATH": "/bin"}


@pytest.mark.parametrize("kwargs, says", [
    ({"venv": "/a", "conda": "b"}, "--venv and --conda: give at most one"),
    ({"python": "/p", "venv": "/a"}, "--python and --venv: give at most one"),
    ({"conda": "my env"}, "--conda 'my env' is not an environment name"),
    ({"venv": " "}, "--venv is empty"),
    ({"python": "/p\n"}, "holds a NUL byte or a newline"),
])
def test_bad_combinations_and_values_are_usage_errors(kwargs, says):
    with pytest.raises(UsageError, match=says):
        JobEnv(**kwargs)


def test_paths_are_made_absolute_from_the_submit_directory_names_stay_names(monkeypatch):
    monkeypatch.setenv("HOME", "/home/ann")
    assert JobEnv(venv=".venv").absolute("/src/proj").venv == "/src/proj/.venv"
    assert JobEnv(venv="~/envs/a").absolute("/src").venv == "/home/ann/envs/a"
    assert JobEnv(python="python3.11").absolute("/src").python == "python3.11"   # on the hosts' PATH
    assert JobEnv(python="bin/py").absolute("/src").python == "/src/bin/py"
    assert JobEnv(conda="c", env_setup="make").absolute("/src") == JobEnv(conda="c", env_setup="make")


def test_setup_request_runs_sh_c_with_the_venvs_environment_and_checks_its_python():
    env = JobEnv(venv="/envs/a", env_setup="pip install -r req.txt")
    req = setup_request(env, cwd="/work", environ={"PATH": "/bin", "K": "v"}, clean_env=True,
                        log="/w/jobs/t/env-setup.log", timeout_s=60)
    assert req == {"argv": ["sh", "-c", "pip install -r req.txt"], "cwd": "/work",
                   "env": {"PATH": "/envs/a/bin:/bin", "VIRTUAL_ENV": "/envs/a", "K": "v"}, "clean_env": True,
                   "log": "/w/jobs/t/env-setup.log", "timeout_s": 60, "check": ["/envs/a/bin/python"]}
    assert setup_request(JobEnv(python="/p/python"), cwd="/", environ={}, clean_env=False, log="l",
                         timeout_s=1)["argv"] is None
    assert JobEnv(python="python3.11").checks() == [] and JobEnv(conda="x").checks() == []


def test_local_checks_name_what_is_missing_unless_a_setup_may_make_it(tmp_path):
    with pytest.raises(UsageError, match="is not a directory"):
        check_local(JobEnv(venv=str(tmp_path / "none")))
    with pytest.raises(UsageError, match="has no bin/python"):
        check_local(JobEnv(venv=str(tmp_path)))
    with pytest.raises(UsageError, match="is not an executable file"):
        check_local(JobEnv(python=str(tmp_path / "py")))
    check_local(JobEnv(venv=str(tmp_path / "none"), env_setup="python3 -m venv none"))
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").write_text("#!/bin/sh\n")
    os.chmod(tmp_path / "bin" / "python", 0o755)
    check_local(JobEnv(venv=str(tmp_path)))


def test_describe_is_one_line_for_status():
    assert describe(JobEnv()) == ""
    assert describe(JobEnv(venv="/e", env_setup="make deps")) == "venv /e; env-setup: make deps"
