"""The container engine's command line for a `submit --image` worker (issue 33):
gpuflex.hosts.container, without an engine (tests/e2e/test_container_jobs.py runs one)."""

from __future__ import annotations

import os

import pytest

from gpuflex.hosts import container


def argv_of(engine="podman", env=None, **kw):
    return container.run_argv(engine, "localhost/img:1", ["python", "train.py", "--lr", "3e-4"],
                              cwd="/work/job", env=env if env is not None else {"A": "x y", "B": "=c"},
                              mounts=kw.pop("mounts", ["/state/job7", "/work/job", "/tmp/gpuflex-7"]),
                              name="gpuflex-g123", **kw)


def words_after(argv, flag):
    return [argv[i + 1] for i, w in enumerate(argv) if w == flag]


def test_podman_runs_the_command_in_the_image_on_the_hosts_network_with_the_job_mounted():
    argv = argv_of(extra=("--ulimit", "nofile=1024:1024"))
    assert argv[:2] == ["podman", "run"]
    assert argv[-5:] == ["localhost/img:1", "python", "train.py", "--lr", "3e-4"]   # the command untouched
    head = argv[:-5]
    assert {"--rm", "--init", "--replace"} <= set(head)
    assert words_after(head, "--network") == ["host"] and words_after(head, "--name") == ["gpuflex-g123"]
    # each directory once, at its own path; the working directory is cwd
    assert words_after(head, "-v") == ["/work/job:/work/job", "/state/job7:/state/job7", "/tmp/gpuflex-7:/tmp/gpuflex-7"]
    assert words_after(head, "-w") == ["/work/job"]
    # the environment by name only: its values are the client's (client_environment), not
    # words of a command line any user of the host reads in /proc
    assert words_after(head, "--env") == ["A", "B"]
    assert "x y" not in argv and "=c" not in " ".join(argv)
    assert head[-2:] == ["--ulimit", "nofile=1024:1024"]   # the host's container_args, before the image
    assert "--device" not in head


def test_gpus_become_cdi_devices_numbered_from_zero_inside():
    argv = argv_of(env={"CUDA_VISIBLE_DEVICES": "3,1"})
    assert words_after(argv, "--device") == ["nvidia.com/gpu=1", "nvidia.com/gpu=3"]
    # inside only GPUs 1 and 3 exist, as 0 and 1: the worker's order kept
    assert words_after(argv, "--env") == ["CUDA_VISIBLE_DEVICES"]
    assert container.client_environment("podman", {"CUDA_VISIBLE_DEVICES": "3,1"}, {})["CUDA_VISIBLE_DEVICES"] == "1,0"


@pytest.mark.parametrize("value", ["", "GPU-0b2c1f3e-aaaa", None])
def test_no_index_list_no_device(value):
    env = {} if value is None else {"CUDA_VISIBLE_DEVICES": value}
    argv = argv_of(env=env)
    assert "--device" not in argv
    assert words_after(argv, "--env") == ["CUDA_VISIBLE_DEVICES"] * (value is not None)
    assert container.client_environment("podman", env, {}) == env   # passed on as it is


def test_docker_has_no_replace_and_apptainer_its_own_words():
    docker = argv_of("docker")
    assert docker[:2] == ["docker", "run"] and "--replace" not in docker and "--init" in docker
    app = argv_of("apptainer", env={"CUDA_VISIBLE_DEVICES": "2"})
    assert app[:2] == ["apptainer", "exec"] and "--nv" in app and "--cleanenv" in app
    assert words_after(app, "--pwd") == ["/work/job"] and "/work/job:/work/job" in words_after(app, "--bind")
    assert "--env" not in app   # apptainer reads APPTAINERENV_* from its client's environment
    assert container.client_environment("apptainer", {"CUDA_VISIBLE_DEVICES": "2", "S": "k"}, {"HOME": "/h"}) == \
        {"HOME": "/h", "APPTAINERENV_CUDA_VISIBLE_DEVICES": "0", "APPTAINERENV_S": "k"}


def test_the_workers_values_are_in_the_clients_environment_and_the_engines_own_stay_its():
    worker = {"GPUFLEX_JOB_SECRET": "s3cr3t", "HOME": "/home/alice", "PATH": "/opt/bin:/usr/bin", "LR": "3e-4"}
    supervisor = {"HOME": "/home/pool", "PATH": "/usr/bin", "XDG_RUNTIME_DIR": "/run/user/7"}
    argv = argv_of(env=worker)
    assert "s3cr3t" not in " ".join(argv)   # the job's secret never on a command line
    # the engine's own variables keep the engine's values (its storage, its runtime), and go
    # in as words: paths, no secret
    assert words_after(argv, "--env") == ["GPUFLEX_JOB_SECRET", "HOME=/home/alice", "PATH=/opt/bin:/usr/bin", "LR"]
    assert container.client_environment("podman", worker, supervisor) == {
        "HOME": "/home/pool", "PATH": "/usr/bin", "XDG_RUNTIME_DIR": "/run/user/7",
        "GPUFLEX_JOB_SECRET": "s3cr3t", "LR": "3e-4"}


def test_an_unknown_engine_is_refused():
    with pytest.raises(ValueError, match="unknown container engine 'lxc'"):
        argv_of("lxc")


def test_the_engine_client_is_found_in_its_group_and_nothing_else():
    cmdlines = {10: ["/usr/bin/podman", "run", "--rm", "img"], 11: ["python", "podman", "run"],
                12: ["docker", "ps"], 13: ["docker", "run", "img"]}
    procs = [(10, "S", 1, 100), (11, "S", 1, 200), (12, "S", 1, 300), (13, "Z", 1, 300)]
    found = {g: container.engine_in_group(g, procs, cmdlines.__getitem__) for g in (100, 200, 300, 400)}
    # only a live `ENGINE run` counts: not a word elsewhere, not another subcommand, not a zombie
    assert found == {100: "podman", 200: None, 300: None, 400: None}
    assert container.engine_in_group(os.getpgrp(), [(os.getpid(), "R", 1, os.getpgrp())]) is None   # /proc read


@pytest.mark.e2e
def test_missing_engine_and_image_are_reasons(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert container.image_missing("podman", "img") == "the container engine podman is not installed"
    fake = tmp_path / "podman"
    fake.write_text("#!/bin/sh\n[ \"$3\" = have ]\n")
    fake.chmod(0o755)
    assert container.image_missing("podman", "have") is None
    assert container.image_missing("podman", "nope") == "podman has no image 'nope' (pull or build it there first)"
    assert container.image_missing("apptainer", "x.sif") is None
    assert container.image_check("docker", "i") == ["docker", "image", "inspect", "i"]
