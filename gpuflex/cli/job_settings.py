"""Where a submitted job's settings come from (issue 33): the command line, the `#GPUFLEX`
and `#SBATCH` directives of a job script, a task file, or the default.

Every layer becomes option words that submit's own parser reads (`make_context` of the
submit command itself): a directive's value is converted and later checked by exactly
the code that checks the option on the command line (no second validator). The layers
are applied lowest first, each setting taken from the highest that gives it:

    default  <  #SBATCH  <  #GPUFLEX or task file  <  command line

`--env` (repeatable) gathers every layer's variables, a higher layer's value winning for
a name both give. What each setting came from is recorded with the job (`jobs.sources`).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from typing import Any, Mapping

import typer

from gpuflex import jobscript, taskfile
from gpuflex.errors import UsageError

try:   # typer >= 0.2x carries its own copy of click; older ones use click itself
    from typer._click.exceptions import UsageError as ClickUsageError
except ImportError:   # pragma: no cover
    from click.exceptions import UsageError as ClickUsageError

COMMAND_LINE, GPUFLEX, SBATCH, TASK_FILE, DEFAULT = "command line", "#GPUFLEX", "#SBATCH", "task file", "default"
NOT_SETTINGS = ("cmd", "as_json")   # the command itself, and how the answer is printed
ORDER = (DEFAULT, SBATCH, GPUFLEX, TASK_FILE, COMMAND_LINE)


@dataclasses.dataclass
class Settings:
    """submit's option values after every layer, and where each came from."""

    values: dict[str, Any]
    sources: dict[str, str]        # setting -> COMMAND_LINE, GPUFLEX, SBATCH, TASK_FILE or DEFAULT
    argv: list[str]
    inherit_env: bool = True       # False: #SBATCH --export=NONE (or a list of names)
    default_name: str | None = None   # a script's or task file's name, when --name is not given
    where: dict[str, str] = dataclasses.field(default_factory=dict)   # setting -> "train.sh line 3"
    warning: str | None = None

    def located(self, error: UsageError) -> UsageError:
        """`error` with the file and line of the directive that set the option it names."""
        text = str(error)
        for name, where in self.where.items():
            flag = "--" + name.replace("_", "-")
            if text.startswith(flag + " ") or text.startswith(flag + ":"):
                return UsageError(f"{where}: {text}")
        return error


def settings(ctx: typer.Context, argv: list[str], environ: Mapping[str, str] | None = None) -> Settings:
    """The job's settings from the command line (`ctx`, already parsed) and the file its
    command names: a task file (`task.toml`: its settings and its `run`), or a job
    script (an existing file: its directives; its path made runnable from the workdir)."""
    environ = os.environ if environ is None else environ
    params = [p for p in ctx.command.params if p.name not in NOT_SETTINGS]
    out = Settings({}, {}, list(argv))
    for p in params:   # each at its default; the command line's own values come last
        given = ctx.get_parameter_source(p.name).name == "COMMANDLINE"
        out.values[p.name] = ([] if given else list(ctx.params[p.name] or [])) if p.multiple else ctx.params[p.name]
        out.sources[p.name] = DEFAULT
    layers: list[tuple[str, str, tuple[str, ...]]] = []   # (source, where, words), lowest first
    script = None   # where in argv the script's path is
    if argv and taskfile.is_task_file(argv[0]):
        layers, out.argv, out.default_name = _task_layers(argv, params)
    elif argv and _script(argv[0]):
        layers, out.inherit_env, out.warning, out.argv = _script_layers(argv, environ)
        script = len(out.argv) - len(argv)
        out.default_name = os.path.basename(argv[0])
    for source, where, words in layers:
        _apply(out, source, where, _parse(ctx, words, where))
    _apply(out, COMMAND_LINE, None, {p.name: ctx.params[p.name] for p in params
                                     if ctx.get_parameter_source(p.name).name == "COMMANDLINE"})
    if out.default_name is not None and out.sources["name"] == DEFAULT:
        out.values["name"] = _job_name(out.default_name)
    if script is not None and out.values.get("workdir") and not os.path.isabs(out.argv[script]):
        # the script was read from here; the workers run in another directory (with --sync,
        # in the sent copy of that directory: a script inside it is named from there)
        path = os.path.abspath(out.argv[script])
        top = os.path.abspath(os.path.expanduser(out.values["workdir"]))
        inside = out.values.get("sync") and path.startswith(top + os.sep)
        out.argv[script] = "./" + os.path.relpath(path, top) if inside else path
    return out


def _apply(out: Settings, source: str, where: str | None, given: Mapping[str, Any]) -> None:
    for name, value in given.items():
        if isinstance(value, (list, tuple)):   # --env: every layer's items, a later one winning
            out.values[name] = list(out.values[name]) + list(value)
            kinds = [k for k in out.sources[name].split(", ") if k != DEFAULT]
            out.sources[name] = ", ".join(sorted(set(kinds) | {source}, key=ORDER.index))
        else:
            out.values[name] = value
            out.sources[name] = source
        if where is None:
            out.where.pop(name, None)
        else:
            out.where[name] = where


def _parse(ctx: typer.Context, words: tuple[str, ...], where: str) -> dict[str, Any]:
    """The options `words` give, read by submit's own parser."""
    for w in words:
        if w in ("--help", "--json"):
            raise UsageError(f"{where}: {w} is not a job setting; give it on the command line.")
    try:
        sub = ctx.command.make_context(ctx.info_name, list(words), parent=ctx.parent)
    except ClickUsageError as e:
        raise UsageError(f"{where}: {' '.join(words)}: {e.format_message()}") from None
    stray = sub.params.get("cmd") or []
    if stray:
        what = f"no such option {stray[0]!r} for submit" if stray[0].startswith("-") else \
            f"{stray[0]!r} is not an option (a directive gives options only)"
        raise UsageError(f"{where}: {what}.")
    return {n: v for n, v in sub.params.items()
            if n not in NOT_SETTINGS and sub.get_parameter_source(n).name == "COMMANDLINE"}


def _script(path: str) -> bool:
    """Whether the command names a script to read: a file (the path as given, from here;
    a bare name only when no program of that name is on PATH)."""
    if "/" not in path and shutil.which(path) is not None:
        return False
    return os.path.isfile(path)


def _script_layers(argv: list[str], environ: Mapping[str, str]):
    path = argv[0]
    try:
        with open(path, "rb") as f:
            head = f.read(jobscript.SNIFF_BYTES)   # a program (the python of `python x.py`) is not read further
            if not jobscript.looks_like_text(head):
                return [], True, None, _runnable(argv, ())
            head += f.read(jobscript.READ_LIMIT - len(head))
    except OSError as e:
        raise UsageError(f"{path}: cannot read the job script: {e.strerror}.") from None
    try:
        found = jobscript.read_directives(head.decode("utf-8", "surrogateescape"))
    except UsageError as e:
        raise UsageError(f"{path} {e}") from None
    layers = []
    try:
        slurm = jobscript.slurm_args(found.of(jobscript.SBATCH), environ)
    except UsageError as e:
        raise UsageError(f"{path} {e}") from None
    layers += [(SBATCH, f"{path} {d.where}: {d.text}", words) for d, words in slurm.args]
    layers += [(GPUFLEX, f"{path} {d.where}", d.words) for d in found.of(jobscript.GPUFLEX)]
    ignored = list(slurm.ignored) + [f"{d.text} ({d.where}, after the first command)" for d in found.late]
    warning = f"{path}: ignored: " + ", ".join(ignored) if ignored else None
    return layers, slurm.inherit_env, warning, _runnable(argv, found.shebang)


def _runnable(argv: list[str], shebang: tuple[str, ...]) -> list[str]:
    """The command that runs the script: a bare name as `./name` (exec looks a name without
    a slash up on PATH); a script that is not executable through its `#!` interpreter, as
    sbatch runs it."""
    path = argv[0] if "/" in argv[0] else "./" + argv[0]
    if shebang and not os.access(argv[0], os.X_OK):
        return [*shebang, path, *argv[1:]]
    return [path, *argv[1:]]


def _task_layers(argv: list[str], params) -> tuple[list, list[str], str]:
    path = argv[0]
    if len(argv) > 1:
        raise UsageError(f"{path}: a task file gives its command in run; give nothing after it.")
    try:
        with open(path, "rb") as f:
            text = f.read(jobscript.READ_LIMIT).decode("utf-8")
    except FileNotFoundError:
        raise UsageError(f"{path}: no such task file.") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{path}: cannot read the task file: {getattr(e, 'strerror', None) or e}.") from None
    options = {p.name: ("/".join(p.opts[:1] + p.secondary_opts[:1]), bool(getattr(p, "is_flag", False)))
               for p in params}
    try:
        keyed, run = taskfile.task_args(text, options)
    except UsageError as e:
        raise UsageError(f"{path}: {e}") from None
    layers = [(TASK_FILE, f"{path} [job] {key}", words) for key, words in keyed if words]
    return layers, run, os.path.splitext(os.path.basename(path))[0]


def _job_name(base: str) -> str:
    """A job name from a file name: `train.sh` -> `train.sh`, with what a name may not hold
    replaced (see requests._NAME)."""
    name = "".join(c if c.isascii() and (c.isalnum() or c in "._-") else "-" for c in base)[:64]
    return name if name[:1].isalnum() else "job" + name[:61]


def sources_text(sources: Mapping[str, str] | None) -> str:
    """`workers from #GPUFLEX, time from #SBATCH, name from command line`: the settings not
    at their default, for `status JOB`; "" when every setting is."""
    given = [(k, v) for k, v in (sources or {}).items() if v != DEFAULT]
    return ", ".join(f"{k} from {v}" for k, v in given)
