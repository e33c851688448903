"""`gpuflex doctor`'s verdicts from facts, without hosts: gpuflex.policy.doctor and
doctor_pairs."""

from __future__ import annotations

import dataclasses
import itertools
import re

import pytest

from gpuflex.config import HostConfig
from gpuflex.policy.doctor import CHECKS, host_findings
from gpuflex.policy.doctor_facts import (DISK_FAIL_BYTES, DISK_WARN_BYTES, TORCH_MIN, Clock, Finding, HostFacts,
                                         HostObservation, PairObservation, PgSide, Reach, Reference, Smi, TorchFacts,
                                         Unanswered, Verdict, WorkdirFacts, exit_code)
from gpuflex.policy.doctor_pairs import pair_findings, pair_rounds, plan
from tests import REPO

REF = Reference(gpuflex="0.1.0", torch="2.13.0")
GPU_HOST = HostConfig(name="gpu01", address="10.0.0.1", gpus=[0, 1], python="python3", workdir="/w")
CPU_HOST = HostConfig(name="box", address="10.0.0.2", gpus="cpu:4", python="python3", workdir="/w")
REACHED = Reach("ssh", user="train", where="10.0.0.1:22", key="ssh-ed25519 SHA256:abc", key_state="pinned")
TORCH = TorchFacts(version="2.13.0+cu128", cuda="12.8", cuda_available=True, device_count=2, gloo=True, nccl=True)
WORKDIR = WorkdirFacts(path="/w", existed=True, is_dir=True, owned=True, mode=0o700, modes_kept=True,
                       free_bytes=100 << 30)
FACTS = HostFacts("3.11.7", "/usr/bin/python3", "0.1.0", "/site/gpuflex", None, TORCH, WORKDIR)
SMI = Smi(gpus=((0, "NVIDIA H100"), (1, "NVIDIA H100")), apps=0, driver="580.159.04")
CLOCK = Clock(0.01, 0.002)
HEALTHY = HostObservation(REACHED, FACTS, SMI, CLOCK)


def lines(host=GPU_HOST, ref=REF, **changes) -> dict[str, Finding]:
    return {f.check: f for f in host_findings(host, dataclasses.replace(HEALTHY, **changes), ref)}


def facts(**changes) -> HostFacts:
    torch = changes.pop("torch", {})
    workdir = changes.pop("workdir", {})
    return dataclasses.replace(FACTS, torch=dataclasses.replace(TORCH, **torch),
                               workdir=dataclasses.replace(WORKDIR, **workdir), **changes)


def test_a_healthy_gpu_host_passes_every_check_in_order():
    found = host_findings(GPU_HOST, HEALTHY, REF)
    assert [f.check for f in found] == list(CHECKS)
    assert {f.check: f.verdict for f in found} == dict.fromkeys(CHECKS, Verdict.OK)
    assert exit_code(found) == 0


def test_a_cpu_host_skips_the_gpu_checks_as_not_configured():
    found = lines(CPU_HOST, smi=None)
    for check in ("nvidia-smi", "gpus", "cuda"):
        assert found[check].verdict is Verdict.SKIP
        assert found[check].detail == 'no GPUs configured (gpus = "cpu:4")'
    assert exit_code(list(found.values())) == 0


VERDICTS = {
    # name: (changes to the healthy observation, check, verdict, words in detail, words in fix)
    "host key unknown": (dict(reach=dataclasses.replace(REACHED, key_state="unknown", stage="key", error="x")),
                         "ssh", Verdict.FAIL, "does not pin", "gpuflex hosts trust gpu01"),
    "host key changed": (dict(reach=dataclasses.replace(REACHED, key_state="mismatch", stage="key", error="x",
                                                        pinned="ssh-ed25519 SHA256:old")),
                         "ssh", Verdict.FAIL, "SHA256:old", "gpuflex hosts trust gpu01"),
    "login refused": (dict(reach=Reach("ssh", where="10.0.0.1:22", stage="login", error="authentication failed")),
                      "ssh", Verdict.FAIL, "authentication failed", "identity_file"),
    "python hangs": (dict(facts=Unanswered("command timed out", timeout_s=7)),
                     "python", Verdict.FAIL, "did not answer within 7 s", "finishes on gpu01"),
    "python fails": (dict(facts=Unanswered("exit 1: broken")), "python", Verdict.FAIL, "exit 1: broken",
                     "set python of gpu01"),
    "gpuflex missing": (dict(facts=facts(gpuflex_version=None, gpuflex_error="ModuleNotFoundError: gpuflex")),
                        "gpuflex", Verdict.FAIL, "not importable", "install gpuflex 0.1.0"),
    "gpuflex of another version": (dict(facts=facts(gpuflex_version="0.2.0")), "gpuflex", Verdict.FAIL,
                                   "0.2.0 on gpu01, 0.1.0 here", "install gpuflex 0.1.0"),
    "torch missing": (dict(facts=facts(torch=dict(error="ModuleNotFoundError: torch"))), "torch", Verdict.FAIL,
                      "not importable", "torch>=2.11"),
    "torch too old": (dict(facts=facts(torch=dict(version="2.1.2"))), "torch", Verdict.FAIL,
                      "needs torch>=2.11", "torch>=2.11"),
    "torch of another minor": (dict(facts=facts(torch=dict(version="2.11.0+cu126"))), "torch", Verdict.WARN,
                               "2.11.0+cu126 on gpu01, 2.13.0 here", "torch 2.13.*"),
    "torch without gloo": (dict(facts=facts(torch=dict(gloo=False))), "torch", Verdict.FAIL, "without gloo",
                           "torch.distributed"),
    "nvidia-smi hangs": (dict(smi=Unanswered("timed out", timeout_s=30)), "nvidia-smi", Verdict.FAIL,
                         "nvidia-smi did not answer within 30 s", "driver"),
    "nvidia-smi missing": (dict(smi=Smi(missing=True)), "nvidia-smi", Verdict.FAIL, "not found", 'gpus = "cpu:N"'),
    "nvidia-smi garbage": (dict(smi=Smi(error="cannot parse what nvidia-smi --query-gpu printed: 'x'")),
                           "nvidia-smi", Verdict.FAIL, "cannot parse", "driver"),
    "stray lines": (dict(smi=dataclasses.replace(SMI, stray=("WARNING: infoROM is corrupted",))), "nvidia-smi",
                    Verdict.WARN, "infoROM", "driver"),
    "a configured GPU missing": (dict(smi=dataclasses.replace(SMI, gpus=((0, "NVIDIA H100"),))), "gpus",
                                 Verdict.FAIL, "no GPU [1]", "set gpus of gpu01"),
    "no GPU at all": (dict(smi=Smi(driver=None)), "gpus", Verdict.FAIL, "lists no GPU", 'gpus = "cpu:N"'),
    "a CPU build of torch": (dict(facts=facts(torch=dict(cuda=None, cuda_available=False, device_count=0))),
                             "cuda", Verdict.WARN, "built without CUDA", "CUDA build of torch"),
    "CUDA torch without a device": (dict(facts=facts(torch=dict(cuda_available=False, device_count=0))),
                                    "cuda", Verdict.WARN, "sees no CUDA device", "driver"),
    "fewer CUDA devices than GPUs": (dict(facts=facts(torch=dict(device_count=1))), "cuda", Verdict.WARN,
                                     "sees 1 of the 2 GPUs", "CUDA_VISIBLE_DEVICES"),
    "workdir not writable": (dict(facts=facts(workdir=dict(error="Not a directory: /w"))), "workdir",
                             Verdict.FAIL, "Not a directory", "set workdir of gpu01"),
    "workdir without modes": (dict(facts=facts(workdir=dict(modes_kept=False))), "workdir", Verdict.FAIL,
                              "0700/0600 do not hold", "keeps file modes"),
    "workdir of another user": (dict(facts=facts(workdir=dict(owned=False))), "workdir", Verdict.WARN,
                                "another user", "set workdir of gpu01"),
    "workdir writable by others": (dict(facts=facts(workdir=dict(mode=0o777))), "workdir", Verdict.WARN,
                                   "mode 0777", "chmod 700 /w"),
    "disk low": (dict(facts=facts(workdir=dict(free_bytes=DISK_WARN_BYTES - 1))), "disk", Verdict.WARN,
                 "under 5 GiB", "free space"),
    "disk full": (dict(facts=facts(workdir=dict(free_bytes=DISK_FAIL_BYTES - 1))), "disk", Verdict.FAIL,
                  "under 256 MiB", "free space"),
    "clock off": (dict(clock=Clock(5.0, 0.01)), "clock", Verdict.WARN, "+5.000 s", "NTP"),
    "clock far off": (dict(clock=Clock(-40.0, 0.01)), "clock", Verdict.FAIL, "-40.000 s", "NTP"),
    "clock unreadable": (dict(clock=Unanswered("exit 1")), "clock", Verdict.WARN, "date: exit 1", "date"),
}


@pytest.mark.parametrize("name", VERDICTS)
def test_each_problem_is_named_with_its_verdict_and_fix(name):
    changes, check, verdict, detail, fix = VERDICTS[name]
    found = lines(**changes)
    assert found[check].verdict is verdict, found[check]
    assert detail in found[check].detail
    assert fix in found[check].fix
    assert exit_code(list(found.values())) == (1 if verdict is Verdict.FAIL else 0)


def test_an_unreachable_host_skips_every_other_check():
    found = lines(reach=Reach("ssh", where="10.0.0.1:22", stage="connect", error="SSH connection refused by 10.0.0.1:22"),
                  facts=None, smi=None, clock=None)
    assert found["ssh"].verdict is Verdict.FAIL and "sshd runs there" in found["ssh"].fix
    assert {c: f.verdict for c, f in found.items() if c != "ssh"} == dict.fromkeys(CHECKS[1:], Verdict.SKIP)


def test_a_python_that_fails_leaves_what_it_would_have_told_unchecked():
    found = lines(facts=Unanswered("exit 1"))
    assert [found[c].verdict for c in ("gpuflex", "torch", "cuda", "workdir", "disk")] == [Verdict.SKIP] * 5
    assert found["nvidia-smi"].verdict is Verdict.OK   # asked apart from python


def test_a_clock_within_the_measurements_own_uncertainty_passes():
    assert lines(clock=Clock(2.5, 0.6))["clock"].verdict is Verdict.OK      # 2.5 - 0.6 <= 2
    assert lines(clock=Clock(2.5, 0.4))["clock"].verdict is Verdict.WARN


def test_the_local_host_passes_ssh_and_clock_as_this_machine():
    local = HostConfig(name="local", gpus="cpu:2")
    found = lines(local, reach=Reach("local", user="alice"), smi=None, clock=None)
    assert found["ssh"].verdict is Verdict.OK and found["ssh"].detail == "local: this machine, as alice"
    assert found["clock"].verdict is Verdict.OK


def test_torch_min_is_pyprojects():
    text = (REPO / "pyproject.toml").read_text()
    assert re.search(r'"torch>=(\d+)\.(\d+),<\d+\.\d+"', text).groups() == tuple(map(str, TORCH_MIN))


def test_facts_from_another_process_are_checked_once_where_they_enter():
    with pytest.raises(ValueError):
        HostFacts.parse({"python": {"version": "3.11"}})
    with pytest.raises(ValueError):
        PgSide.parse({"stage": "done"})
    side = PgSide.parse({"rank": 1, "stage": "done", "results": {"gloo": {"sum": 2.0, "s": 0.5}}})
    assert side.ok and side.seconds == (("gloo", 0.5),)


# ---- pairs -----------------------------------------------------------------------------------
@pytest.mark.parametrize("n", range(1, 8))
def test_pair_rounds_take_every_pair_once_and_each_host_once_a_round(n):
    names = [f"h{i}" for i in range(n)]
    rounds = pair_rounds(names)
    pairs = [p for r in rounds for p in r]
    assert sorted(pairs) == list(itertools.combinations(names, 2))
    for r in rounds:
        hosts = [h for p in r for h in p]
        assert len(hosts) == len(set(hosts))
    assert len(rounds) <= n


def test_nccl_is_checked_only_where_both_hosts_have_gpus_and_see_cuda():
    other = dataclasses.replace(GPU_HOST, name="gpu02")
    assert plan(GPU_HOST, HEALTHY, other, HEALTHY) == (("gloo", "nccl"), [])
    cpu_torch = dataclasses.replace(HEALTHY, facts=facts(torch=dict(cuda_available=False)))
    backends, skipped = plan(GPU_HOST, HEALTHY, other, cpu_torch)
    assert backends == ("gloo",)
    assert [(f.host, f.check, f.verdict, f.detail) for f in skipped] == [
        ("gpu01+gpu02", "pg nccl", Verdict.SKIP, "not checked: torch on gpu02 sees no CUDA")]
    assert plan(GPU_HOST, HEALTHY, CPU_HOST, HEALTHY) == (("gloo",), [])
    broken = dataclasses.replace(HEALTHY, facts=Unanswered("exit 1"))
    backends, skipped = plan(GPU_HOST, broken, CPU_HOST, HEALTHY)
    assert backends == () and [f.detail for f in skipped] == ["not checked: gpuflex or torch is not usable on gpu01"]


def pair(s0: PgSide | Unanswered, s1: PgSide | Unanswered, backends=("gloo",)) -> list[Finding]:
    return pair_findings(PairObservation("gpu01", "gpu02", "10.0.0.1", 10.0, backends, port=41000, sides=(s0, s1)))


DONE = PgSide(0, "done", seconds=(("gloo", 0.05), ("nccl", 0.2)))


def test_a_pair_that_all_reduced_passes_naming_the_store():
    [f] = pair(DONE, dataclasses.replace(DONE, rank=1))
    assert (f.host, f.check, f.verdict) == ("gpu01+gpu02", "pg gloo", Verdict.OK)
    assert "store at 10.0.0.1:41000 on gpu01" in f.detail


def test_a_port_rank_1_cannot_reach_is_named_with_both_hosts():
    waiting = PgSide(0, "init", "gloo", "Timed out after 10 s waiting for rank 1")
    [f] = pair(waiting, PgSide(1, "connect", None, "Connection refused"))
    assert f.verdict is Verdict.FAIL
    assert f.detail == "port 41000 on gpu01 not reachable from gpu02 within 10 s (Connection refused)"
    assert "firewall" in f.fix


def test_a_port_taken_on_rank_0s_host_is_named_with_what_the_other_side_saw():
    [f] = pair(PgSide(0, "listen", None, "Address already in use"), PgSide(1, "connect", None, "timed out"))
    assert f.detail == ("port 41000 on gpu01: cannot listen (Address already in use); "
                        "from gpu02 it did not answer within 10 s (timed out)")


def test_a_store_that_does_not_answer_is_told_from_either_side():
    [f] = pair(PgSide(0, "done"), PgSide(1, "store", None, "Timed out after 13 s connecting"))
    assert f.detail == "gpu02 reached port 41000 on gpu01, but no store answered there: Timed out after 13 s connecting"
    [f] = pair(PgSide(0, "store", None, "Wait timeout"), PgSide(1, "import", None, "x"))
    assert f.detail == "rank 1 on gpu02 stopped at import: x"
    [f] = pair(PgSide(0, "store", None, "Wait timeout"), PgSide(1, "done"))
    assert f.detail == "rank 1 on gpu02 did not come to the store at port 41000 on gpu01: Wait timeout"


def test_a_failed_backend_fails_alone():
    s1 = PgSide(1, "init", "nccl", "NCCL error: unhandled system error", seconds=(("gloo", 0.05),))
    gloo, nccl = pair(PgSide(0, "init", "nccl", "timeout", seconds=(("gloo", 0.05),)), s1, ("gloo", "nccl"))
    assert gloo.verdict is Verdict.OK and nccl.verdict is Verdict.FAIL
    assert nccl.detail.startswith("the nccl group did not form (rank 0 on gpu01)")


def test_a_side_that_never_answered_is_named():
    [f] = pair(DONE, Unanswered("timed out", timeout_s=42))
    assert f.detail == "rank 1 on gpu02 did not answer within 42 s" and f.verdict is Verdict.FAIL
