"""Job commands: submit, logs, events (status: status_cmd.py; scale: scale_cmd.py; cancel,
hold, release, update, requeue: verbs_cmd.py)."""

from __future__ import annotations

from typing import Optional

import typer

import gpuflex.cli.render as render
import gpuflex.cli.job_settings as job_settings
import gpuflex.cli.verbs_cmd as verbs_cmd
from gpuflex.cli.common import StopSignals, command, console, err_console, known_job, obj, print_json
from gpuflex.cli.scale_cmd import scale
from gpuflex.cli.status_cmd import ENDED_SHOWN, status  # noqa: F401 (ENDED_SHOWN: read here before)
from gpuflex.control.requests import SubmitRequest, parse_env, parse_ref, parse_workers
from gpuflex.errors import UsageError
from gpuflex.jobenv import JobEnv
from gpuflex.jobspec import After, parse_after, parse_array, parse_time
from gpuflex.states import JobState


def register(app: typer.Typer) -> None:
    app.command(context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True})(submit)
    app.command()(status)   # status_cmd.py
    app.command()(scale)
    verbs_cmd.register(app)   # cancel, hold, release, update, requeue: verbs_cmd.py
    app.command()(logs)
    app.command()(events)


# Help texts are rich markup (typer's rich markup mode): "[jobs]" would be read as a tag and
# vanish, so a config table's name is written "\\[jobs]" (tests/cli/test_help.py walks every help).
@command
def submit(
    ctx: typer.Context,
    cmd: Optional[list[str]] = typer.Argument(None, metavar="-- CMD ARGS...", help="The command each worker runs: "
                                              "a job script (train.sh: its #GPUFLEX and #SBATCH lines are read) or "
                                              "a task file (task.toml) brings its settings too."),
    name: Optional[str] = typer.Option(None, "--name", help="A name for the job (default: the program's name)."),
    workers: str = typer.Option("1", "--workers", "-w", help="N, or MIN:MAX for an elastic job."),
    gpus_per_worker: int = typer.Option(1, "--gpus-per-worker", help="GPUs (or CPU slots) per worker."),
    priority: int = typer.Option(0, "--priority", help="Higher runs first."),
    harvest: bool = typer.Option(False, "--harvest", help="Let 'gpuflex harvest' grow it onto idle GPUs."),
    env: Optional[list[str]] = typer.Option(None, "--env", "-e", help="KEY=VALUE for the workers (repeatable)."),
    workdir: Optional[str] = typer.Option(None, "--workdir", help="Working directory of the workers (default: here)."),
    retries: int = typer.Option(0, "--retries", help="Restarts (from the last checkpoint) allowed after a worker "
                                "crashes: an exception or a non-zero exit is a bug, so by default the job fails. "
                                "Signals and lost hosts are faults the job rides out; they never count."),
    elastic: Optional[str] = typer.Option(None, "--elastic", help="How the job changes size: inplace (a "
                                          "gpuflex.elastic script; default for MIN:MAX) or restart (a script that "
                                          "resumes from its own checkpoint: relaunched at each resize). A fixed "
                                          "--workers N runs as a gang (torchrun's contract) without it."),
    time: Optional[str] = typer.Option(None, "--time", help="Time limit: 90s, 30m, 4h, 2d or 1-12:00:00 (a bare "
                                       "number is minutes, as in Slurm); then SIGTERM, grace, SIGKILL, state "
                                       "timeout. Default: \\[jobs] default_time."),
    after: Optional[str] = typer.Option(None, "--after", help="What must end first, as Slurm's --dependency: "
                                        "job ids (or array ids) that must succeed (12,13 or afterok:12:13; if one "
                                        "fails or is cancelled, so is this job), afterany:ID (ended, however), "
                                        "afternotok:ID (failed, cancelled or timed out; cancelled if it "
                                        "succeeds), singleton (no other job of this name of mine runs or is "
                                        "queued ahead); joined by commas, all must hold. "
                                        "E.g. --after afterok:12,singleton."),
    array: Optional[str] = typer.Option(None, "--array", help="Submit an array: 0-15, 1,3,5, with %N for at "
                                        "most N running at once (0-15%4); each gets GPUFLEX_ARRAY_INDEX."),
    requeue: bool = typer.Option(False, "--requeue", help="Let a higher-priority job preempt it: stopped "
                                 "(SIGTERM, grace) and requeued."),
    notify: Optional[str] = typer.Option(None, "--notify", help="Webhook URL (http or https): a JSON POST when "
                                         "the job ends, fails, is preempted or times out. Default: \\[notify] url."),
    split: Optional[str] = typer.Option(None, "--split", help="How an in-place job's global batch is divided over "
                                        "its workers: speed (in proportion to each worker's measured speed, for "
                                        "mixed GPUs; default) or even."),
    resume_from: Optional[str] = typer.Option(None, "--resume-from", help="An in-place job starts from this "
                                              "checkpoint directory of an earlier job, at any world size."),
    sync: Optional[bool] = typer.Option(None, "--sync/--no-sync", show_default=False,
                                        help="Send the working directory to the hosts (packed once, "
                                        "minding .gitignore, at most \\[jobs] sync_cap_mib; a host that already "
                                        "has this tree gets nothing) and run there; outputs stay on the host "
                                        "(gpuflex fetch brings them back). --no-sync: run in the working "
                                        "directory on every host, whatever \\[jobs] sync or a host's sync say "
                                        "(the default when neither is given). "
                                        "E.g. gpuflex submit --sync -- python train.py."),
    python: Optional[str] = typer.Option(None, "--python", help="Run a command that starts with python or "
                                         "python3 with this interpreter instead (a path on the hosts, or a "
                                         "name on their PATH). E.g. gpuflex submit --python /opt/py311/bin/python "
                                         "-- python train.py."),
    venv: Optional[str] = typer.Option(None, "--venv", help="Run the workers in this virtualenv (a path on the "
                                       "hosts): its bin first on PATH and VIRTUAL_ENV set, as after "
                                       "'source VENV/bin/activate'. E.g. gpuflex submit --venv ~/envs/torch2 -- "
                                       "python train.py."),
    conda: Optional[str] = typer.Option(None, "--conda", help="Run the command in this conda environment "
                                        "(conda run -n NAME --no-capture-output CMD; conda on the hosts' PATH). "
                                        "E.g. gpuflex submit --conda torch2 -- python train.py. At most one of "
                                        "--python, --venv and --conda."),
    env_setup: Optional[str] = typer.Option(None, "--env-setup", help="A shell command run once per host per "
                                            "run, before that host's workers, in the job's directory with its "
                                            "environment; if it fails, so does the job (its last lines in the "
                                            "reason). E.g. gpuflex submit --venv .venv --env-setup 'test -d .venv "
                                            "|| python3 -m venv .venv && .venv/bin/pip install -r "
                                            "requirements.txt' -- python train.py."),
    image: Optional[str] = typer.Option(None, "--image", help="Run each worker in a container of this image, "
                                        "through its host's engine (a host's container key: podman by default), "
                                        "on the host's network with the job's directory mounted and its GPUs "
                                        "passed in. E.g. gpuflex submit --image localhost/train:1 -- python "
                                        "train.py."),
    as_json: bool = typer.Option(False, "--json", help="Print the job object as JSON."),
) -> None:
    """Record a job and place it on free GPUs or slots; prints the job id.

    Example: gpuflex submit --name mlp --workers 1:4 -- python examples/elastic_mlp.py --epochs 3

    A job script as the command brings its settings (docs/job-scripts.md): #GPUFLEX lines (submit's options)
    and the #SBATCH options that map, in its leading comment block; the command line overrides them.
    A task file (task.toml: a \\[job] table with the options and run = "CMD") is the other way.

    Example: gpuflex submit train.sh (or gpuflex submit --priority 5 train.sh), with train.sh:
      #!/bin/bash
      #GPUFLEX --workers 1:4
      #SBATCH --job-name=mlp --time=2:00:00
      python examples/elastic_mlp.py --epochs 3
    """
    argv = [a for a in (cmd or [])]
    if argv and argv[0] == "--":
        argv = argv[1:]
    if argv and argv[0].startswith("-"):
        # an option submit does not know, given before '--' (the parser passes those on
        # with the command), or a command named like an option: neither is run
        raise UsageError(f"no such option {argv[0]!r} for submit; give options before '--' and the command "
                         "after it, e.g. gpuflex submit --workers 2 -- python train.py.")
    given = job_settings.settings(ctx, argv)
    if given.warning:
        err_console.print(f"warning: {given.warning}")
    try:   # a refusal names the directive or task file key that gave the value it names
        req = _request(given)   # checked before the database is opened
        svc = obj(ctx).service()
        job_id = svc.submit(req)
    except UsageError as e:
        raise given.located(e) from None
    job = svc.job(job_id, events=False)
    if as_json:
        print_json(render.job_json(job))
    elif req.array is not None:
        console.print(render.array_submitted(job.id, len(req.array.indices), req.array.limit))
    elif job.state in (JobState.FAILED, JobState.CANCELLED):   # cancelled: a dependency already ended badly
        console.print(f"job {job.id} ({job.name}) {job.state}: {job.exit_reason}")
    else:
        console.print(f"job {job.id} ({job.name}) {job.state}"
                      + (f": {job.queue_reason}" if job.queue_reason else
                         f" with {job.world_size} worker(s)"))
    if job.state in (JobState.FAILED, JobState.CANCELLED):
        raise typer.Exit(1)


def _request(given: job_settings.Settings) -> SubmitRequest:
    """The request the settings make, checked by the same parsers whatever layer gave them."""
    v = given.values
    lo, hi = parse_workers(v["workers"])
    return SubmitRequest(argv=given.argv, name=v["name"], min_workers=lo, max_workers=hi,
                         gpus_per_worker=v["gpus_per_worker"], priority=v["priority"], harvest=v["harvest"],
                         env=parse_env(v["env"] or []), workdir=v["workdir"], retries=v["retries"],
                         elastic=v["elastic"], time_limit_s=parse_time(v["time"]) if v["time"] is not None else None,
                         after=parse_after(v["after"]) if v["after"] is not None else After(),
                         array=parse_array(v["array"]) if v["array"] is not None else None,
                         requeue=v["requeue"], notify=v["notify"], split=v["split"], resume_from=v["resume_from"],
                         environ=None if given.inherit_env else {}, sources=dict(given.sources),
                         sync=v["sync"], job_env=JobEnv(python=v["python"], venv=v["venv"], conda=v["conda"],
                                                        env_setup=v["env_setup"]),
                         image=v["image"])


@command
def logs(
    ctx: typer.Context,
    job: str = typer.Argument(..., help="A job id or name."),
    worker: Optional[int] = typer.Option(None, "--worker", help="Only this rank (or worker id, if no rank matches)."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing until the job ends."),
    setup: bool = typer.Option(False, "--setup", help="Print the output of the job's --env-setup instead, "
                               "from each host it ran on. E.g. gpuflex logs 3 --setup."),
) -> None:
    """Print worker output.

    Example: gpuflex logs 3 --worker 0 --follow
    """
    parse_ref(job)
    if setup and worker is not None:
        raise UsageError("--setup prints each host's --env-setup output; give it without --worker.")
    svc = obj(ctx).service()
    known_job(svc, job)
    svc.check_reader(job, "logs")
    svc.refresh()
    j = svc.job(job, events=setup)
    if setup:   # issue 33: where each host's preparation wrote (gpuflex.control.prepare)
        logs_at = {(e.data.get("host"), e.data.get("log")) for e in j.events
                   if e.kind in ("env-ready", "env-setup") and e.data.get("log")}
        if not j.env_setup or not logs_at:
            raise UsageError(f"job {j.id} has no --env-setup output "
                             f"({'no host ran it yet' if j.env_setup else 'it has no --env-setup'}).")
        with StopSignals() as stop:
            _follow(svc, [(host, host, path) for host, path in sorted(logs_at)], j.id, follow, stop)
        return
    chosen = list(j.workers)
    if worker is not None:
        chosen = [w for w in j.workers if w.rank == worker and not w.state.final] \
            or [w for w in j.workers if w.rank == worker] or [w for w in j.workers if w.wid == worker]
        if not chosen:
            raise UsageError(f"job {j.id} has no worker with rank or id {worker}.")
    targets = [(w.host, f"w{w.wid}", w.log_path) for w in chosen]
    with StopSignals() as stop:
        _follow(svc, targets, j.id, follow, stop)


def _follow(svc, targets, job_id: int, follow: bool, stop: StopSignals) -> None:
    """Print what the log files hold; with `follow`, go on until the job ends or Ctrl-C."""
    offsets = {t: 0 for t in targets}
    pending = {t: "" for t in targets}  # an unfinished line, held back so its prefix is printed once
    many = len(targets) > 1

    def emit(text: str, label: str) -> None:
        if many:
            text = "".join(f"[{label}] {line}" for line in text.splitlines(keepends=True))
        if text:
            console.out(text, end="", highlight=False)

    while True:
        for t in targets:
            host, label, path = t
            while True:  # one read returns at most 1 MiB: drain what the file holds now
                data = svc.pool.transport(host).read(path, offsets[t])
                offsets[t] = data["offset"]
                if not data["data"]:
                    break
                text = data["data"]
                if many:
                    head, nl, pending[t] = (pending[t] + text).rpartition("\n")
                    text = head + nl
                emit(text, label)
        if not follow:
            for t in targets:
                if pending[t]:
                    emit(pending[t] + "\n", t[1])
            return
        svc.refresh()
        if svc.job(job_id, events=False).state.final:
            follow = False  # one last read, then stop
            continue
        if stop.sleep(0.5):
            follow = False      # Ctrl-C: one last read, then stop


@command
def events(
    ctx: typer.Context,
    job: str = typer.Argument(..., help="A job id or name."),
    as_json: bool = typer.Option(False, "--json", help="Print the events as a JSON array."),
) -> None:
    """Scale and fault history of a job, with per-phase timings.

    Example: gpuflex events 3 --json
    """
    parse_ref(job)
    svc = obj(ctx).service()
    known_job(svc, job)
    svc.check_reader(job, "events")
    svc.refresh()
    j = svc.job(job)
    if as_json:
        print_json([render.event_json(e) for e in j.events])
    else:
        console.print(render.events_table(j, list(j.events)))
