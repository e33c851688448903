"""Task files (gpuflex/taskfile.py): a [job] table's keys as submit's option words."""

from __future__ import annotations

import pytest

from gpuflex.errors import UsageError
from gpuflex.taskfile import is_task_file, task_args

OPTIONS = {"name": ("--name", False), "workers": ("--workers", False), "harvest": ("--harvest", True),
           "requeue": ("--requeue", True), "sync": ("--sync/--no-sync", True), "env": ("--env", False), "after": ("--after", False),
           "time": ("--time", False), "gpus_per_worker": ("--gpus-per-worker", False)}


def test_each_key_becomes_its_options_words_and_run_the_command():
    keyed, run = task_args('[job]\nname = "mlp"\nworkers = "1:4"\ngpus_per_worker = 2\nharvest = true\n'
                           'requeue = false\nenv = { LR = "3e-4", SEED = 1 }\nafter = [3, 4]\ntime = 90\n'
                           'run = "python train.py --lr \'3e-4\'"\n', OPTIONS)
    assert keyed == [("name", ("--name", "mlp")), ("workers", ("--workers", "1:4")),
                     ("gpus_per_worker", ("--gpus-per-worker", "2")), ("harvest", ("--harvest",)),
                     ("requeue", ()), ("env", ("--env", "LR=3e-4", "--env", "SEED=1")),
                     ("after", ("--after", "3,4")), ("time", ("--time", "90"))]
    assert run == ["python", "train.py", "--lr", "3e-4"]
    keyed, _ = task_args('[job]\nsync = false\nrun = "x"\n', OPTIONS)
    assert keyed == [("sync", ("--no-sync",))]   # a two-way flag's false is its other word
    assert task_args('[job]\nsync = true\nrun = "x"\n', OPTIONS)[0] == [("sync", ("--sync",))]


def test_run_may_be_a_list_and_env_a_list_of_items():
    keyed, run = task_args('[job]\nenv = ["A=1"]\nrun = ["python", "a b.py"]\n', OPTIONS)
    assert keyed == [("env", ("--env", "A=1"))] and run == ["python", "a b.py"]


@pytest.mark.parametrize("text,message", [
    ("[job]\nworkers = \n", "not TOML"),
    ('[job]\nbogus = 1\nrun = "x"\n', r"\[job\] bogus: unknown key; the keys are run and"),
    ('[job]\ngpus-per-worker = 2\nrun = "x"\n', "gpus-per-worker: unknown key .write keys with underscores"),
    ('name = "x"\n[job]\nrun = "x"\n', "unknown table or key 'name'"),
    ('[jobs]\nrun = "x"\n', "unknown table or key 'jobs'"),
    ("", "no \\[job\\] table"),
    ('[job]\nname = "x"\n', "has no run"),
    ('[job]\nrun = ""\n', "run is empty"),
    ('[job]\nrun = 3\n', "run: give the command"),
    ('[job]\nrun = "a \'b"\n', "split as a shell"),
    ('[job]\nharvest = "yes"\nrun = "x"\n', "harvest = 'yes': give true or false"),
    ('[job]\nworkers = [1]\nrun = "x"\n', "workers = \\[1\\]: give a string or a number"),
])
def test_bad_task_files_are_refused_naming_what_is_wrong(text, message):
    with pytest.raises(UsageError, match=message):
        task_args(text, OPTIONS)


def test_a_task_file_is_told_by_its_suffix():
    assert is_task_file("task.toml") and is_task_file("dir/t.toml") and not is_task_file("train.sh")
