"""Which spawns a fork can run as a fresh interpreter would, and which zygote serves them
(gpuflex.hosts.forkrun, gpuflex.hosts.zygote; the processes themselves: test_zygote.py)."""

from __future__ import annotations

import pytest

from gpuflex.hosts import forkrun, zygote


@pytest.mark.parametrize("argv,parsed", [
    (["python3", "train.py", "--lr", "0.1"], ("script", "train.py", ["--lr", "0.1"], False)),
    (["/v/bin/python3.11", "-u", "t.py"], ("script", "t.py", [], True)),
    (["python", "-m", "pkg.mod", "x"], ("module", "pkg.mod", ["x"], False)),
    (["python3", "-u", "-m", "mod"], ("module", "mod", [], True)),
])
def test_a_python_script_or_module_is_forkable(argv, parsed):
    assert forkrun.parse_python_argv(argv) == parsed


@pytest.mark.parametrize("argv", [
    ["python3"], ["python3", "-c", "print(1)"], ["python3", "-m"], ["python3", "-m", "-x"], ["bash", "t.py"],
    ["python3", "-O", "t.py"], ["python3", "-X", "dev", "t.py"], ["torchrun", "t.py"], ["pythonw", "t.py"],
    ["/usr/bin/env", "python3", "t.py"]])
def test_anything_else_starts_cold(argv):
    assert forkrun.parse_python_argv(argv) is None


def spec(**kw):
    return {"argv": ["python3", "train.py"], "socket_dir": "/s", "fork_start": True, "clean_env": True,
            "env": {"PATH": "/v/bin", "MINE": "job"}, **kw}


def test_only_a_spec_that_asks_and_that_a_fork_runs_the_same_way_is_forked():
    assert zygote.forkable(spec())
    assert not zygote.forkable(spec(fork_start=False))
    assert not zygote.forkable(spec(container={"engine": "podman", "image": "x"}))
    assert not zygote.forkable(spec(socket_dir=None))
    assert not zygote.forkable(spec(argv=["sh", "-c", "python3 train.py"]))


def test_workers_that_differ_only_in_their_own_variables_share_a_zygote():
    one = spec(env={"PATH": "/v/bin", "MINE": "job", "GPUFLEX_WORKER_ID": "0", "CUDA_VISIBLE_DEVICES": "0",
                    "OMP_NUM_THREADS": "4", "RANK": "0", "MASTER_PORT": "1"})
    two = spec(env={"PATH": "/v/bin", "MINE": "job", "GPUFLEX_WORKER_ID": "1", "CUDA_VISIBLE_DEVICES": "1",
                    "OMP_NUM_THREADS": "2", "RANK": "1", "MASTER_PORT": "2"})
    assert zygote.zygote_key(one) == zygote.zygote_key(two)
    assert zygote.zygote_env({"A": "1", "GPUFLEX_X": "2", "CUDA_VISIBLE_DEVICES": "3", "TORCHELASTIC_RUN_ID": "r"}) \
        == {"A": "1"}
    # another common variable (what the zygote's imports may read) or interpreter: another zygote
    assert zygote.zygote_key(spec(env={"PATH": "/v/bin", "MINE": "other"})) != zygote.zygote_key(spec())
    assert zygote.zygote_key(spec(argv=["/other/python3", "train.py"])) != zygote.zygote_key(spec())
