"""The directive lines of a job script and the #SBATCH options that map onto submit's
(gpuflex/jobscript.py): pure text in, submit's option words out."""

from __future__ import annotations

import pytest

from gpuflex.errors import UsageError
from gpuflex.jobscript import GPUFLEX, SBATCH, after_text, export_env, read_directives, slurm_args, slurm_options
from gpuflex.jobspec import parse_time


def words(text: str, environ=None) -> list[tuple[int, tuple[str, ...]]]:
    """(line, option words) of a script's #SBATCH lines."""
    got = slurm_args(read_directives(text).of(SBATCH), environ or {})
    return [(d.line, w) for d, w in got.args]


def test_directives_are_read_from_the_leading_comment_block_after_the_shebang():
    found = read_directives("#!/bin/bash -l\n# a note\n\n#SBATCH --time=10 # till lunch\n"
                            "#GPUFLEX --workers 1:4 --env 'A=a b'\n#SBATCHX --no\n  #SBATCH --indented\n"
                            "echo go\n#SBATCH --late\n#GPUFLEX --late\n")
    assert [(d.kind, d.line, d.words) for d in found.lines] == [
        (SBATCH, 4, ("--time=10",)), (GPUFLEX, 5, ("--workers", "1:4", "--env", "A=a b"))]
    assert [(d.kind, d.line) for d in found.late] == [(SBATCH, 9), (GPUFLEX, 10)]
    assert found.shebang == ("/bin/bash", "-l")


def test_a_script_without_a_shebang_or_directives_has_none():
    found = read_directives("python train.py\n#SBATCH --time=5\n")
    assert found.lines == () and [d.line for d in found.late] == [2] and found.shebang == ()
    assert read_directives("").lines == ()


def test_an_unclosed_quote_in_a_directive_is_refused_naming_its_line():
    with pytest.raises(UsageError, match="line 2: .*#GPUFLEX --name 'x"):
        read_directives("#!/bin/sh\n#GPUFLEX --name 'x\n")


def test_sbatch_options_are_read_in_each_of_its_spellings():
    found = read_directives("#SBATCH --time=5 -J first -t10 --mem 4G\n#SBATCH -n 4 --requeue --partition=gpu\n")
    opts = [(o.name, o.value) for o in slurm_options(list(found.lines))]
    assert opts == [("time", "5"), ("job-name", "first"), ("time", "10"), ("mem", "4G"), ("ntasks", "4"),
                    ("requeue", None), ("partition", "gpu")]


def test_the_options_that_map_become_submits_and_the_rest_are_named_as_ignored():
    got = slurm_args(read_directives(
        "#SBATCH --job-name=mlp --time=1-00:30\n#SBATCH --mem=4G -p gpu --output=%j.log\n"
        "#SBATCH --array=0-3%2 --requeue -D /data --frobnicate\n").of(SBATCH), {})
    assert [w for _, w in got.args] == [("--name", "mlp"), ("--time", "1-00:30"), ("--array", "0-3%2"),
                                        ("--workdir", "/data"), ("--requeue",)]
    assert got.ignored == ("--mem=4G (line 2)", "--partition=gpu (line 2)", "--output=%j.log (line 2)",
                           "--frobnicate (line 3)")
    assert got.inherit_env


def test_the_last_of_an_option_wins_and_no_requeue_cancels_requeue():
    assert words("#SBATCH -t 5\n#SBATCH --time=7\n") == [(2, ("--time", "7"))]
    assert words("#SBATCH --requeue\n#SBATCH --no-requeue\n") == []


@pytest.mark.parametrize("text,seconds", [("5", 300), ("5:30", 330), ("01:02:03", 3723), ("2-3", 2 * 86400 + 3 * 3600),
                                          ("2-03:04", 2 * 86400 + 3 * 3600 + 240),
                                          ("2-03:04:05", 2 * 86400 + 3 * 3600 + 245), ("00:00:05", 5)])
def test_an_sbatch_time_in_each_of_slurms_formats_is_its_seconds(text, seconds):
    ((_, (flag, value)),) = words(f"#SBATCH --time={text}\n")
    assert flag == "--time" and parse_time(value) == seconds


@pytest.mark.parametrize("text", ["1:xx", "1-", "abc", "00:00:00"])
def test_a_malformed_sbatch_time_is_refused_by_submits_own_parser(text):
    ((_, (_, value)),) = words(f"#SBATCH --time={text}\n")
    with pytest.raises(UsageError, match="--time"):
        parse_time(value)


@pytest.mark.parametrize("lines,expected", [
    ("#SBATCH --ntasks=4", [("--workers", "4")]),
    ("#SBATCH -n 4 --gpus-per-task=2", [("--workers", "4"), ("--gpus-per-worker", "2")]),
    ("#SBATCH --nodes=2 --gres=gpu:4", [("--workers", "2"), ("--gpus-per-worker", "4")]),
    ("#SBATCH -N 2 --ntasks-per-node=4 --gres=gpu:a100:4", [("--workers", "8"), ("--gpus-per-worker", "1")]),
    ("#SBATCH --nodes=2 --ntasks=8 --gpus-per-node=8", [("--workers", "8"), ("--gpus-per-worker", "2")]),
    ("#SBATCH --nodes=1-4", [("--workers", "1:4")]),
    ("#SBATCH --ntasks=2 --gpus=4", [("--workers", "2"), ("--gpus-per-worker", "2")]),
    ("#SBATCH --gres=gpu:2", [("--gpus-per-worker", "2")]),
])
def test_tasks_nodes_and_gpus_become_workers_and_gpus_per_worker(lines, expected):
    assert [w for _, w in words(lines + "\n")] == expected


def test_a_gpu_count_that_does_not_divide_among_the_tasks_is_refused_naming_the_line():
    with pytest.raises(UsageError, match="line 2: .*3 GPU.* 2 task"):
        words("#!/bin/sh\n#SBATCH -N 2 --ntasks-per-node=2 --gres=gpu:3\n")
    with pytest.raises(UsageError, match="--nodes 'x' is not a number|give --nodes"):
        words("#SBATCH --nodes=x\n")


def test_other_gres_and_a_gpu_type_are_named_as_ignored():
    got = slurm_args(read_directives("#SBATCH --gres=gpu:v100:2,tmpfs:10G\n").of(SBATCH), {})
    assert [w for _, w in got.args] == [("--gpus-per-worker", "2")]
    assert got.ignored == ("GPU type 'v100' of --gres (line 1)", "--gres=tmpfs:10G (line 1)")


@pytest.mark.parametrize("dependency,after", [("afterok:12", "12"), ("afterok:12:13", "12,13"),
                                              ("afterok:12,afterok:14", "12,14"),
                                              ("afterany:12:13", "afterany:12:13"), ("singleton", "singleton"),
                                              ("afterok:1?afterok:2", "afterok:1?afterok:2")])
def test_a_dependency_becomes_after_with_afterok_as_ids_and_other_kinds_passed_through(dependency, after):
    assert after_text(dependency) == after
    assert words(f"#SBATCH --dependency={dependency}\n") == [(1, ("--after", after))]


@pytest.mark.parametrize("text,inherit,items", [
    ("ALL", True, []), ("NONE", False, []), ("ALL,LR=3e-4", True, ["LR=3e-4"]),
    ("LR=3e-4,HOMEDIR", False, ["LR=3e-4", "HOMEDIR=/h"]), ("NONE,MISSING", False, []),
    ("ALL,HOMEDIR", True, ["HOMEDIR=/h"]),
])
def test_export_keeps_all_none_or_only_the_named_variables(text, inherit, items):
    assert export_env(text, {"HOMEDIR": "/h"}) == (inherit, items)


def test_export_in_a_script_becomes_env_items_and_whether_the_environment_is_kept():
    got = slurm_args(read_directives("#SBATCH --export=NONE,A=1\n").of(SBATCH), {})
    assert [w for _, w in got.args] == [("--env", "A=1")] and not got.inherit_env


def test_an_option_that_needs_a_value_and_has_none_is_refused():
    with pytest.raises(UsageError, match="--time needs a value"):
        words("#SBATCH --time\n")
