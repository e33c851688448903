"""Named failpoints: faults a test arms at chosen places of a real job.

A fault matrix (kill rank 0 while a resize copies state, stop a worker inside the gradient
collective, fill the disk under a checkpoint) needs the fault to land in one exact phase of
one exact process, every run. Killing from outside lands wherever the victim happens to be
on a loaded machine; a failpoint is a named place in the code, and the process faults
itself there when a rule names it. It is the shape of TiKV's `fail-rs`: the places stay in
the shipped code, switched off unless armed.

Armed only through the environment (`GPUFLEX_FAILPOINTS`, read once at import, passed by
`gpuflex submit` to the coordinator and the workers) or `arm()` in a unit test. Unarmed, a
place costs one module-global truth test, because callers write

    if failpoints.ARMED: failpoints.hit("resize.copy", wid=wid, rank=rank, gen=gen)

Spec: rules separated by `;`, each `NAME[@FILTER[,FILTER...]]=ACTION[:ARG]`. Filters, all
of which must hold (values are ints): `wid=N`, `rank=N`, `gen=N` (equal), `step=N` (the
step is at least N), `hit=N` (the Nth time this process reaches NAME with the other
filters holding; without it, the first). A context value the place does not pass makes a
filter on it fail, except `wid`: a worker's own id (`GPUFLEX_WORKER_ID`) stands in, so a
place that does not know it (`checkpoint.write`) still fires in one chosen worker. A rule fires at most once per process, except `sleep`, which fires every
time its filters hold. Actions: `kill` (SIGKILL itself), `stop` (SIGSTOP itself; a test
sends SIGCONT), `exit:N` (`os._exit(N)`), `raise` (RuntimeError), `sleep:S` (seconds),
`oserror:ENAME` (OSError with that errno, e.g. `oserror:ENOSPC`). Before acting the process
writes one line `failpoint NAME ACTION pid=P key=value...` to stderr, flushed, so its log
shows what fired.

A bad spec is refused when it is armed, naming the rule: a test that arms a typo must fail,
not silently test nothing. So are names missing from `POINTS`, the list of every place. A
process whose environment holds a bad spec exits 2 at import with one `error:` line.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

from gpuflex.elastic.protocol.env import WORKER_ID

ENV = "GPUFLEX_FAILPOINTS"

POINTS: dict[str, str] = {
    "startup.before_join": "worker runtime started, before it joins the rendezvous",
    "formation.join": "joined the forming generation, before its process group is built",
    "formation.group": "process group built, before the state sync",
    "formation.verify": "before the members agree on the state checksum",
    "steady.collective": "inside a steady step, right before the gradient all-reduce",
    "resize.detect": "a member saw a new generation at a step boundary",
    "resize.agree": "after the members agreed to switch, before the old group is torn down",
    "resize.rebuild": "before the new generation's process group is built",
    "resize.copy": "before the state copy to newcomers (sender and newcomer side)",
    "resize.verify": "before the resized generation's state checksum",
    "resize.first_step": "the first step after the switch to a new generation",
    "split.replan": "a member made a new split of the global batch, before the step that commits it",
    "checkpoint.write": "checkpoint written to its temporary file, before the rename",
    "cancel.stop": "SIGTERM seen, before the final checkpoint",
    "training.finished": "the last step committed and checkpointed, before the script's code after it",
    "coordinator.publish": "coordinator, before it publishes a generation",
    "coordinator.formed": "coordinator, after it recorded a formed generation",
    "scale.spawned": "gpuflex scale: newcomers spawned, before the resize request is sent",
    "scale.requested": "gpuflex scale: resize request sent, before the wait for it",
    "start.spawned": "a command starting a job: its processes spawned, before the transaction commits",
}

ACTIONS = ("kill", "stop", "exit", "raise", "sleep", "oserror")
FILTERS = ("wid", "rank", "gen", "step", "hit")

ARMED = False


class FailpointSpecError(ValueError):
    """A failpoint spec that cannot be armed; the message names the bad rule."""

    def __init__(self, rule: str, reason: str) -> None:
        super().__init__(f"{ENV}: bad rule {rule!r}: {reason}")
        self.rule = rule
        self.reason = reason


@dataclass
class Rule:
    """One armed rule and what this process has counted for it."""

    name: str
    action: str
    arg: str = ""
    filters: dict[str, int] = field(default_factory=dict)
    reached: int = 0
    fired: bool = False

    def text(self) -> str:
        return f"{self.action}:{self.arg}" if self.arg else self.action

    def holds(self, ctx: dict[str, object]) -> bool:
        """Whether the filters other than `hit` hold for this context."""
        for key, want in self.filters.items():
            if key == "hit":
                continue
            have = ctx.get(key, _OWN_WID if key == "wid" else None)
            if not isinstance(have, int) or isinstance(have, bool):
                return False
            if (have < want) if key == "step" else (have != want):
                return False
        return True


def _own_wid() -> int | None:
    text = os.environ.get(WORKER_ID, "")
    return int(text) if text.isascii() and text.isdigit() else None


_OWN_WID = _own_wid()
_rules: list[Rule] = []
_lock = threading.RLock()   # reentrant: a signal handler may reach a point mid-hit


def parse(spec: str) -> list[Rule]:
    """The rules of `spec`; raises FailpointSpecError naming the first bad one."""
    return [_parse_rule(text.strip()) for text in spec.split(";") if text.strip()]


def _parse_rule(text: str) -> Rule:
    head, eq, action_text = text.rpartition("=")
    if not eq or not head:
        raise FailpointSpecError(text, "expected NAME[@FILTER,...]=ACTION[:ARG]")
    name, at, filter_text = head.partition("@")
    name = name.strip()
    if at and not filter_text.strip():
        raise FailpointSpecError(text, "empty filter list after '@'")
    if name not in POINTS:
        raise FailpointSpecError(text, f"unknown failpoint {name!r} (see failpoints.POINTS)")
    action, _, arg = action_text.strip().partition(":")
    _check_action(text, action, arg)
    return Rule(name, action, arg, _parse_filters(text, filter_text))


def _parse_filters(text: str, filter_text: str) -> dict[str, int]:
    filters: dict[str, int] = {}
    if not filter_text.strip():
        return filters
    for item in filter_text.split(","):
        key, eq, value = item.strip().partition("=")
        if not eq or key not in FILTERS:
            raise FailpointSpecError(text, f"bad filter {item.strip()!r}: one of "
                                           f"{', '.join(f + '=N' for f in FILTERS)}")
        if key in filters:
            raise FailpointSpecError(text, f"filter {key!r} given twice")
        filters[key] = _int(text, key, value)
    if filters.get("hit", 1) < 1:
        raise FailpointSpecError(text, "hit counts from 1")
    return filters


def _int(text: str, key: str, value: str) -> int:
    value = value.strip()
    if not value.isascii() or not value.lstrip("-").isdigit():
        raise FailpointSpecError(text, f"{key} needs an integer, not {value!r}")
    return int(value)


def _check_action(text: str, action: str, arg: str) -> None:
    if action not in ACTIONS:
        raise FailpointSpecError(text, f"unknown action {action!r}: one of {', '.join(ACTIONS)}")
    if action in ("kill", "stop", "raise"):
        if arg:
            raise FailpointSpecError(text, f"{action} takes no argument")
    elif action == "exit":
        if not arg.isascii() or not arg.isdigit() or int(arg) > 255:
            raise FailpointSpecError(text, "exit needs a status 0..255, e.g. exit:3")
    elif action == "sleep":
        try:
            seconds = float(arg)
        except ValueError:
            seconds = -1.0
        if not 0 <= seconds < 86400:
            raise FailpointSpecError(text, "sleep needs seconds, e.g. sleep:2.5")
    elif not isinstance(getattr(errno, arg, None), int) or not arg.startswith("E"):
        raise FailpointSpecError(text, "oserror needs an errno name, e.g. oserror:ENOSPC")


def arm(spec: str) -> list[Rule]:
    """Arm `spec` in place of any earlier rules (all or nothing) and return the rules."""
    global ARMED
    rules = parse(spec)
    with _lock:
        _rules[:] = rules
        ARMED = bool(rules)
    return list(rules)


def disarm() -> None:
    global ARMED
    with _lock:
        _rules.clear()
        ARMED = False


def hit(name: str, **ctx: object) -> None:
    """Fault here if an armed rule names this place and its filters hold.

    `ctx` is what the place knows of wid, rank, gen and step (the filters' keys); other
    keys only go into the stderr line. Returns when nothing fires, or after `stop` and
    `sleep`; `raise` and `oserror` raise, `kill` and `exit` do not return.
    """
    if name not in POINTS:
        raise KeyError(f"failpoint {name!r} is not in failpoints.POINTS")
    with _lock:
        rule = _due(name, ctx)
    if rule is not None:
        _act(rule, ctx)


def _due(name: str, ctx: dict[str, object]) -> Rule | None:
    """The first rule due at this reach. Every rule whose filters hold counts the reach,
    whichever fires: `hit=2` is the second reach even when another rule fired at the first."""
    due = None
    for rule in _rules:
        if rule.name != name or (rule.fired and rule.action != "sleep") or not rule.holds(ctx):
            continue
        rule.reached += 1
        if due is None and rule.reached >= rule.filters.get("hit", 1):
            rule.fired = True
            due = rule
    return due


def _act(rule: Rule, ctx: dict[str, object]) -> None:
    _announce(rule, ctx)
    if rule.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif rule.action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif rule.action == "exit":
        os._exit(int(rule.arg))
    elif rule.action == "raise":
        raise RuntimeError(f"failpoint {rule.name}")
    elif rule.action == "sleep":
        time.sleep(float(rule.arg))
    else:
        code = getattr(errno, rule.arg)
        raise OSError(code, f"{os.strerror(code)} (failpoint {rule.name})")


def _announce(rule: Rule, ctx: dict[str, object]) -> None:
    words = [f"failpoint {rule.name} {rule.text()} pid={os.getpid()}"]
    words += [f"{key}={value}" for key, value in ctx.items()]
    _write(" ".join(words) + "\n")


def _write(line: str) -> None:
    stream = sys.stderr
    try:
        if stream is None:
            raise OSError
        stream.write(line)
        stream.flush()
    except (OSError, ValueError):
        os.write(2, line.encode(errors="replace"))


def _arm_from_environment() -> None:
    """A process started with a bad spec ends at once (exit 2, one `error:` line): a worker,
    the coordinator or a gpuflex command alike, before it does anything untested."""
    spec = os.environ.get(ENV, "")
    if not spec.strip():
        return
    try:
        arm(spec)
    except FailpointSpecError as e:
        _write(f"error: {e}\n")
        raise SystemExit(2) from None


_arm_from_environment()
