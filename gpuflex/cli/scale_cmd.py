"""`gpuflex scale JOB N [--wait]`: resize a running elastic job (an in-place job at a step
boundary, a restart job by a relaunch at N), and with --wait follow the switch until the new
size runs (a shrink's leavers gone), the job ends, or the resize settles at another size (the
newcomers the coordinator left out, and why)."""

from __future__ import annotations

import threading
import time
from typing import Callable

import typer

import gpuflex.cli.render as render
from gpuflex.cli.common import StopSignals, command, console, err_console, obj, seconds
from gpuflex.control.requests import parse_count, parse_ref
from gpuflex.errors import INTERRUPTED_EXIT, JobError
from gpuflex.policy import leavers
from gpuflex.policy.lifecycle import LEFT_OUT_KIND
from gpuflex.states import JobState, WorkerState


@command
def scale(
    ctx: typer.Context,
    job: str = typer.Argument(..., help="A job id or name."),
    n: int = typer.Argument(..., help="The number of workers wanted (within the job's MIN:MAX)."),
    wait: bool = typer.Option(False, "--wait", help="Wait until the job runs at N workers (a shrink's "
                                                    "leavers exited, their devices free)."),
    timeout: float = typer.Option(300, "--timeout", help="Seconds to wait with --wait (1 to 86400)."),
) -> None:
    """Resize a running elastic job to N workers, within its MIN:MAX.

    An in-place job (--elastic inplace, the default for MIN:MAX) resizes in place at its next
    step boundary: its workers go on, newcomers warm up and join, leavers exit. A restart job
    (--elastic restart) is stopped (SIGTERM, the grace period, SIGKILL) and launched again at
    N workers, resuming from its own checkpoint. A fixed gang (--workers N) is not resized.
    Without --wait, a shrink still waits up to 30 s for its leavers to exit, so their rows
    end with their processes (a slower leaver's end is recorded by the next command).

    Example: gpuflex scale 3 4 --wait
    """
    parse_ref(job)
    parse_count("N", n, 1)
    seconds("--timeout", timeout, 1.0)   # less could not even ask: it would always end "not finished"
    svc = obj(ctx).service()
    svc.check_scale(job, n)   # unknown, not ours, a gang, N out of range: refused before the refresh writes
    deadline = time.monotonic() + timeout
    asked: list[float] = []
    scaled: list = []

    leaving_before: set[int] = set()

    def request() -> None:
        svc.refresh()
        leaving_before.update(_leaving(svc.job(job, events=False)))
        asked.append(time.time())
        scaled.append(svc.scale(job, n))

    if not wait:
        request()
    elif not _within(deadline, request):   # the lock or a host held up the request itself
        raise JobError(f"job {job}: the resize to {n} did not finish within {timeout:.0f} s (it was still "
                       "waiting to be asked for; see gpuflex status).")
    j = scaled[0]
    console.print(f"job {j.id}: resizing to {n} worker(s)")
    if not wait:
        if _leaving(j) - leaving_before:   # this shrink's leavers: their ends recorded as they exit
            _watch_leavers(svc, j.id)
        return
    switched = None
    with StopSignals() as stop:
        while time.monotonic() < deadline:
            if stop.sleep(min(0.5, max(0.0, deadline - time.monotonic()))) or stop.requested:
                err_console.print(f"job {j.id}: stopped waiting; the resize goes on (see gpuflex status {j.id}).")
                raise typer.Exit(INTERRUPTED_EXIT)
            if not _within(deadline, svc.refresh):
                break
            cur = svc.job(j.id, events=False)
            if cur.state.final:
                raise JobError(f"job {cur.id} ended ({cur.state}) before the resize finished.")
            if cur.state is JobState.RUNNING and cur.world_size == n:
                if any(w.state is WorkerState.LEAVING for w in cur.workers):
                    continue   # a shrink is done once its leavers are gone too: their devices are free then
                switched = switched or time.monotonic()
                ev = [e for e in cur.recent if e.kind in ("scale", "fault", "formed")
                      and e.data.get("generation") == cur.generation]
                # the phase timings come with the first step after the switch
                if ev or time.monotonic() - switched > 10:
                    console.print(f"job {cur.id}: world size {n} at generation {cur.generation}"
                                  + (f" ({render.phases(ev[-1].data)})" if ev else ""))
                    return
            elif cur.state is JobState.RUNNING and (why := _ended_short(svc, cur, asked[0])) is not None:
                raise JobError(f"job {cur.id}: the resize to {n} ended at {cur.world_size} worker(s): {why}")
    raise JobError(f"job {j.id}: the resize to {n} did not finish within {timeout:.0f} s.")


def _leaving(info) -> set[int]:
    return {w.wid for w in info.workers if w.state is WorkerState.LEAVING}


def _watch_leavers(svc, job_id: int) -> None:
    """A shrink's leavers exit a step or two after the switch: their ends are recorded as
    they exit, for SCALE_WATCH_S at most (gpuflex.policy.leavers), so the database does not
    show them `leaving` after their processes are gone. Ctrl-C stops the watch (exit 130)."""
    still = svc.watch_leavers(job_id, leavers.SCALE_WATCH_S)
    if still:
        console.print(f"job {job_id}: worker(s) {', '.join(map(str, still))} still leaving after "
                      f"{leavers.SCALE_WATCH_S:.0f} s; the next command records their end.")


def _within(deadline: float, work: Callable[[], object]) -> bool:
    """`work()` (a refresh: it waits for the database's lock and asks hosts and the
    coordinator) waited for until `deadline` (monotonic) at most: True once it returned
    (its exception raised here), False when the time ran out first. The thread is then
    left to end on its own (a daemon: the command's exit ends it, and its transaction is
    undone, as for a command killed mid-refresh)."""
    done, failed = threading.Event(), []

    def run() -> None:
        try:
            work()
        except BaseException as e:  # noqa: BLE001 - raised again in the waiting thread
            failed.append(e)
        finally:
            done.set()

    threading.Thread(target=run, name="gpuflex-scale-wait", daemon=True).start()
    if not done.wait(max(0.0, deadline - time.monotonic())):
        return False
    if failed:
        raise failed[0]
    return True


def _ended_short(svc, cur, asked: float) -> str | None:
    """Why a resize asked for at `asked` (wall clock) settled at another size: the job went
    back to running since (a "state" event), with the newcomers the coordinator left out
    (their "left-out" events: worker, host, phase) or that event's message; None while
    it has not. Events recorded since, whatever the coordinator's clock dated them."""
    back = [e for e in cur.recent if e.kind == "state" and e.data.get("state") == JobState.RUNNING.value
            and e.recorded_at >= asked]
    if not back:
        return None
    left = [e.message for e in svc.job(cur.id).events if e.kind == LEFT_OUT_KIND and e.recorded_at >= asked]
    return "; ".join(left) or back[-1].message
