"""The examples: the DDP script converts to gpuflex.elastic in a few lines, and both run."""

from __future__ import annotations

import difflib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import REPO

pytestmark = pytest.mark.e2e   # runs the examples as scripts

EXAMPLES = REPO / "examples"


def torch_teardown_abort(stderr: str) -> bool:
    """torch 2.13's known exit race, after the script's own work is done: an all-reduce that DDP
    launched inside backward keeps a Python object in its thread-local state, and when gloo's
    worker thread frees it while the interpreter is already finalizing, the thread cannot take the
    GIL and the process aborts ("terminate called without an active exception"; see pytorch
    PR 179291). Under load it hits a few percent of torchrun runs of the plain DDP script. Only
    this exact signature is forgiven; the report is still checked in full."""
    return ("terminate called without an active exception" in stderr and "SIGABRT" in stderr
            and stderr.count("Traceback (most recent call last)") == 1)   # torchrun's own, no worker's


def code(path: Path) -> list[str]:
    """The script from its first import on (the docstring describes each file)."""
    lines = path.read_text().splitlines()
    return lines[next(i for i, ln in enumerate(lines) if ln.startswith("import ")):]


def test_the_ddp_script_converts_with_at_most_15_changed_lines():
    diff = list(difflib.unified_diff(code(EXAMPLES / "ddp_mlp.py"), code(EXAMPLES / "elastic_mlp.py"), n=0))
    added = [ln for ln in diff if ln.startswith("+") and not ln.startswith("+++")]
    removed = [ln for ln in diff if ln.startswith("-") and not ln.startswith("---")]
    assert 0 < len(added) <= 15, "\n".join(added)
    assert len(removed) <= 15, "\n".join(removed)
    assert any("run.backward(loss)" in ln for ln in added)
    readme = (EXAMPLES.parent / "README.md").read_text().replace("\n", " ")
    assert f"elastic_mlp: {len(added)} lines added, {len(removed)} removed" in readme   # the README's count is true


def test_the_elastic_example_runs_standalone_and_the_ddp_one_under_torchrun(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFLEX_")}
    report = tmp_path / "alone.json"
    subprocess.run([sys.executable, str(EXAMPLES / "elastic_mlp.py"), "--epochs", "1", "--hidden", "16",
                    "--report", str(report)], check=True, env=env, timeout=300)
    r = json.loads(report.read_text())
    assert r["steps"] == 32 and sorted(r["samples"]["0"]) == list(range(2048))
    assert [s for s, _, ws in r["step_log"]] == list(range(32)) and {ws for *_, ws in r["step_log"]} == {1}
    ddp = tmp_path / "ddp.json"
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                        str(EXAMPLES / "ddp_mlp.py"), "--epochs", "1", "--hidden", "16", "--report", str(ddp)],
                       env=env, timeout=300, capture_output=True, text=True)
    assert p.returncode == 0 or torch_teardown_abort(p.stderr), p.stderr[-3000:]
    d = json.loads(ddp.read_text())
    assert d["steps"] == 32 and len(d["params"]) == len(r["params"])


def conversion_counts(folder: Path) -> tuple[int, int]:
    """(lines added, lines removed) from ddp.py to elastic.py, from the first import on."""
    diff = list(difflib.unified_diff(code(folder / "ddp.py"), code(folder / "elastic.py"), n=0))
    return (sum(ln.startswith("+") and not ln.startswith("+++") for ln in diff),
            sum(ln.startswith("-") and not ln.startswith("---") for ln in diff))


def test_the_readme_quotes_the_real_conversion_line_counts():
    readme = " ".join((EXAMPLES.parent / "README.md").read_text().split())
    for name in ("cnn_bn", "transformer_lm"):
        added, removed = conversion_counts(EXAMPLES / name)
        assert 0 < added < removed
        assert f"`examples/{name}/`" in readme
        assert f"{name}: {added} lines added, {removed} removed" in readme, (name, added, removed)


def test_the_real_examples_run_standalone_and_under_torchrun(tmp_path):
    """Both conversions run alone (the report: every sample once, the run's steps), and
    their plain DDP versions under torchrun with 2 processes, on tiny settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFLEX_")}
    runs = {"cnn_bn": ["--samples", "96", "--global-batch-size", "32", "--epochs", "2"],
            "transformer_lm": ["--steps", "6", "--eval-interval", "5", "--eval-iters", "1"]}
    for name, args in runs.items():
        alone = tmp_path / f"{name}.json"
        subprocess.run([sys.executable, str(EXAMPLES / name / "elastic.py"), *args, "--report", str(alone)],
                       check=True, env=env, timeout=300)
        r = json.loads(alone.read_text())
        assert [s for s, _, ws in r["step_log"]] == list(range(r["steps"])) and r["steps"] == 6
        assert {ws for *_, ws in r["step_log"]} == {1} and r["loss"] > 0
        ddp = tmp_path / f"{name}.ddp.json"
        p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                            str(EXAMPLES / name / "ddp.py"), *args, "--report", str(ddp)],
                           env=env, timeout=300, capture_output=True, text=True)
        assert p.returncode == 0 or torch_teardown_abort(p.stderr), p.stderr[-3000:]
        d = json.loads(ddp.read_text())
        assert len(d["params"]) == len(r["params"]) and d["loss"] > 0
    cnn = json.loads((tmp_path / "cnn_bn.json").read_text())
    assert [sorted(cnn["samples"][e]) for e in ("0", "1")] == [list(range(96))] * 2
    lm = json.loads((tmp_path / "transformer_lm.json").read_text())
    assert [e[0] for e in lm["evals"]] == [0, 5] and lm["best_val_loss"] == min(e[2] for e in lm["evals"])
