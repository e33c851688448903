"""Job scripts (issue 33): the `#GPUFLEX` and `#SBATCH` directive lines at the top of a script
submitted as the command, read the way sbatch reads them, and the `#SBATCH` options that
map onto submit's own options. Pure text in, option words out: the words are parsed by
submit's own parser (gpuflex/cli/job_settings.py), so a directive's value is checked by the
same code as the option given on the command line, and nothing here validates a value.

Where the directives are: the script's leading comment block, after an optional `#!`
line, up to the first line that is neither blank nor a comment (sbatch's rule). A
directive starts its line: `#GPUFLEX --workers 1:4`, `#SBATCH --time=00:10:00`; its words
are split as a shell splits them, and `#` after a space starts a comment.

How `#SBATCH` maps (docs/job-scripts.md has the table): a gpuflex worker is one process
holding `--gpus-per-worker` devices, as a Slurm task holding `--gpus-per-task`; so
`--ntasks N` is `--workers N`, `--nodes N` (or `MIN-MAX`) is N (MIN:MAX) workers times
`--ntasks-per-node`, and GPUs per node (`--gres=gpu:G`, `--gpus-per-node`) are shared by
that node's tasks. Where the workers land is gpuflex's placement: nodes are not pinned.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from typing import Mapping

from gpuflex.errors import UsageError

GPUFLEX = "#GPUFLEX"
SBATCH = "#SBATCH"
READ_LIMIT = 1 << 20   # bytes of a script read for its directives: they sit at its top
SNIFF_BYTES = 4096     # the first bytes, which tell a script from a program (a NUL byte)

# sbatch's short options, as the long ones they stand for (the ones a script uses)
SHORT = {"J": "job-name", "t": "time", "n": "ntasks", "N": "nodes", "a": "array", "d": "dependency",
         "G": "gpus", "D": "chdir", "o": "output", "e": "error", "p": "partition", "c": "cpus-per-task",
         "A": "account", "q": "qos", "C": "constraint", "w": "nodelist", "x": "exclude", "i": "input",
         "L": "licenses", "M": "clusters", "b": "begin", "F": "nodefile", "k": "no-kill", "m": "distribution"}
# sbatch options (and short letters) that take no value: a word after one is not its value
FLAGS = {"requeue", "no-requeue", "exclusive", "hold", "overcommit", "contiguous", "wait", "parsable",
         "test-only", "spread-job", "use-min-nodes", "ignore-pbs", "no-kill", "quiet", "verbose",
         "oversubscribe", "help", "usage", "H", "O", "W", "Q", "v", "s", "h", "k"}
# the sbatch options this module maps (the rest are named in the caller's warning)
MAPPED = {"job-name", "time", "ntasks", "nodes", "ntasks-per-node", "gpus-per-task", "gpus-per-node", "gres",
          "gpus", "array", "dependency", "requeue", "no-requeue", "export", "chdir"}


@dataclasses.dataclass(frozen=True)
class Directive:
    """One directive line: its kind (GPUFLEX or SBATCH), 1-based line number, words, text."""

    kind: str
    line: int
    words: tuple[str, ...]
    text: str

    @property
    def where(self) -> str:
        return f"line {self.line}"


@dataclasses.dataclass(frozen=True)
class Directives:
    """What a script's top says: its directives in order, and those after the first
    command (sbatch reads none of them; the caller names them in its warning)."""

    lines: tuple[Directive, ...] = ()
    late: tuple[Directive, ...] = ()
    shebang: tuple[str, ...] = ()   # the `#!` line's interpreter and its argument, if any

    def of(self, kind: str) -> list[Directive]:
        return [d for d in self.lines if d.kind == kind]


def looks_like_text(head: bytes) -> bool:
    """Whether a file's first bytes are a script's, not a program's (no NUL byte)."""
    return b"\0" not in head[:SNIFF_BYTES]


def read_directives(text: str) -> Directives:
    """The directives of a script's leading comment block (see the module's doc); a
    directive line whose words cannot be split (an unclosed quote) is a UsageError."""
    lines = text.splitlines()
    shebang: tuple[str, ...] = ()
    start = 0
    if lines and lines[0].startswith("#!"):
        # the kernel's reading: the interpreter, then the rest of the line as one argument
        interp, _, arg = lines[0][2:].strip().partition(" ")
        shebang = (interp,) + ((arg.strip(),) if arg.strip() else ())
        start = 1
    found, late, in_block = [], [], True
    for n, raw in enumerate(lines[start:], start + 1):
        stripped = raw.strip()
        if in_block and stripped and not stripped.startswith("#"):
            in_block = False
        kind = next((k for k in (GPUFLEX, SBATCH) if raw.startswith(k) and raw[len(k):len(k) + 1] in ("", " ", "\t")),
                    None)
        if kind is None:
            continue
        body = raw[len(kind):]
        try:
            words = tuple(shlex.split(body, comments=True))
        except ValueError as e:
            raise UsageError(f"line {n}: {raw.strip()!r}: {e} (directive words are split as a shell splits "
                             "them).") from None
        d = Directive(kind, n, words, raw.strip())
        (found if in_block else late).append(d)
    return Directives(tuple(found), tuple(late), shebang)


@dataclasses.dataclass(frozen=True)
class SlurmOption:
    name: str            # the long name, without dashes
    value: str | None    # None: given without a value
    directive: Directive

    @property
    def text(self) -> str:
        return f"--{self.name}" + (f"={self.value}" if self.value is not None else "")


def slurm_options(directives: list[Directive]) -> list[SlurmOption]:
    """The options of `#SBATCH` lines, in order, as sbatch reads them: `--opt=value`,
    `--opt value`, `-t 10`, `-t10`. A word that is no option is kept as an option named
    by itself, without a value, for the caller's warning."""
    out = []
    for d in directives:
        words = list(d.words)
        i = 0
        while i < len(words):
            w = words[i]
            i += 1
            if w.startswith("--"):
                name, eq, value = w[2:].partition("=")
                short = False
            elif w.startswith("-") and len(w) > 1:
                name, value, eq = SHORT.get(w[1], w[1]), w[2:].lstrip("="), bool(w[2:])
                short = True
            else:
                out.append(SlurmOption(w, None, d))
                continue
            if not eq and (w[1] if short else name) not in FLAGS and name not in FLAGS \
                    and i < len(words) and not words[i].startswith("-"):
                value, eq = words[i], True
                i += 1
            out.append(SlurmOption(name, value if eq else None, d))
    return out


@dataclasses.dataclass(frozen=True)
class SlurmArgs:
    """What `#SBATCH` lines come to: submit's option words, each with the directive it
    came from; the options ignored (`--mem=4G (line 5)`); and whether the job keeps its
    submitter's environment (`--export=NONE` or a list of names: only those)."""

    args: tuple[tuple[Directive, tuple[str, ...]], ...]
    ignored: tuple[str, ...]
    inherit_env: bool = True


def slurm_args(directives: list[Directive], environ: Mapping[str, str]) -> SlurmArgs:
    """Map `#SBATCH` lines onto submit's options (see the module's doc); `environ` gives
    the values of the variables `--export` names without one. A value this cannot
    compute from (a node count that is not a number) is a UsageError naming its line."""
    opts: dict[str, SlurmOption] = {}
    ignored = []
    for o in slurm_options(directives):
        if o.name in MAPPED:
            opts[o.name] = o    # sbatch: the last of an option wins
        else:
            ignored.append(f"{o.text} ({o.directive.where})")
    args: list[tuple[Directive, tuple[str, ...]]] = []

    def put(option: str, flag: str, value: str | None = None) -> None:
        if option in opts:
            args.append((opts[option].directive, (flag,) if value is None else (flag, value)))

    for option, flag in (("job-name", "--name"), ("time", "--time"), ("array", "--array"), ("chdir", "--workdir")):
        if option in opts:
            put(option, flag, _value(opts[option]))
    if "requeue" in opts and "no-requeue" not in opts:
        put("requeue", "--requeue")
    if "dependency" in opts:
        put("dependency", "--after", after_text(_value(opts["dependency"])))
    workers, gpus, more = _sizes(opts)
    ignored.extend(more)
    if workers is not None:
        args.append((workers[0], ("--workers", workers[1])))
    if gpus is not None:
        args.append((gpus[0], ("--gpus-per-worker", gpus[1])))
    inherit = True
    if "export" in opts:
        inherit, items = export_env(_value(opts["export"]), environ)
        args.extend((opts["export"].directive, ("--env", item)) for item in items)
    return SlurmArgs(tuple(args), tuple(ignored), inherit)


def _value(o: SlurmOption) -> str:
    if o.value is None or o.value == "":
        raise UsageError(f"{o.directive.where}: {o.directive.text!r}: --{o.name} needs a value.")
    return o.value


def after_text(dependency: str) -> str:
    """`--dependency` as `--after`'s text: `afterok:12:13` (or several afterok parts, all
    to hold) is `12,13`; any other kind goes through as written, for `--after` to take
    or refuse."""
    parts = [p for p in dependency.split(",") if p]
    ids = []
    for p in parts:
        kind, _, rest = p.partition(":")
        if kind != "afterok" or not rest or "?" in p:
            return dependency
        ids.extend(rest.split(":"))
    return ",".join(ids) if ids else dependency


def export_env(text: str, environ: Mapping[str, str]) -> tuple[bool, list[str]]:
    """`--export`: (whether the submitter's environment is kept, `--env` items). ALL (the
    default) keeps it; NONE keeps none of it; a list of names keeps only those (NAME from
    `environ`, if set there; NAME=value as given), with ALL in the list keeping the rest too."""
    words = [w.strip() for w in text.split(",") if w.strip()]
    keywords = {w.upper() for w in words} & {"ALL", "NONE", "NIL"}
    named = [w for w in words if w.upper() not in keywords]
    items = [w if "=" in w else f"{w}={environ[w]}" for w in named if "=" in w or w in environ]
    inherit = "ALL" in keywords or (not keywords and not named)
    return inherit and not keywords & {"NONE", "NIL"}, items


_NODES = re.compile(r"([0-9]+)(?:-([0-9]+))?")


def _number(o: SlurmOption, text: str | None = None) -> int:
    raw = _value(o) if text is None else text
    if not raw.isascii() or not raw.isdigit() or len(raw) > 9:
        raise UsageError(f"{o.directive.where}: {o.directive.text!r}: --{o.name} {raw!r} is not a number.")
    return int(raw)


def _gpu_count(o: SlurmOption) -> tuple[int | None, list[str]]:
    """GPUs per node of `--gres=gpu[:type]:G[,other...]` or `--gpus-per-node=[type:]G`;
    what else it asks for (another resource, a GPU type) goes to the warning."""
    count, other = None, []
    for part in _value(o).split(","):
        bits = part.split(":")
        if o.name == "gres" and bits[0] != "gpu":
            other.append(f"--gres={part} ({o.directive.where})")
            continue
        if o.name == "gres":
            bits = bits[1:]
        if len(bits) > 1:
            other.append(f"GPU type {bits[0]!r} of --{o.name} ({o.directive.where})")
        count = _number(o, bits[-1] if bits else "1")
    return count, other


def _sizes(opts: dict[str, SlurmOption]) -> tuple[tuple[Directive, str] | None, tuple[Directive, str] | None,
                                                  list[str]]:
    """(--workers, --gpus-per-worker) from the task, node and GPU counts, each with the
    directive it comes from; and what of them is ignored."""
    ignored: list[str] = []
    per_node = opts.get("ntasks-per-node")
    tpn = _number(per_node) if per_node is not None else None
    workers = None
    if "ntasks" in opts:
        workers = (opts["ntasks"].directive, _value(opts["ntasks"]))
    elif "nodes" in opts:
        o = opts["nodes"]
        m = _NODES.fullmatch(_value(o))
        if not m:
            raise UsageError(f"{o.directive.where}: {o.directive.text!r}: give --nodes as N or MIN-MAX.")
        lo = int(m.group(1)) * (tpn or 1)
        hi = int(m.group(2)) * (tpn or 1) if m.group(2) else lo
        workers = (o.directive, f"{lo}:{hi}" if hi != lo else str(lo))
    elif per_node is not None:
        workers = (per_node.directive, str(tpn))
    gpus = None
    if "gpus-per-task" in opts:
        gpus = (opts["gpus-per-task"].directive, _value(opts["gpus-per-task"]))
    node_gpus = opts.get("gres") or opts.get("gpus-per-node")
    if gpus is None and node_gpus is not None:
        count, other = _gpu_count(node_gpus)
        ignored.extend(other)
        if count is not None:
            tasks = tpn or 1
            if tpn is None and "ntasks" in opts and "nodes" in opts and _NODES.fullmatch(_value(opts["nodes"])) \
                    and "-" not in _value(opts["nodes"]):
                tasks = max(1, _number(opts["ntasks"]) // max(1, _number(opts["nodes"])))
            if count % tasks:
                raise UsageError(f"{node_gpus.directive.where}: {node_gpus.directive.text!r}: {count} GPU(s) per "
                                 f"node do not divide among {tasks} task(s) per node; give --gpus-per-task.")
            gpus = (node_gpus.directive, str(count // tasks))
    elif node_gpus is not None:
        ignored.append(f"--{node_gpus.name}={node_gpus.value} ({node_gpus.directive.where}; --gpus-per-task given)")
    if gpus is None and "gpus" in opts:
        o = opts["gpus"]
        total = _number(o, _value(o).split(":")[-1])
        n = workers[1] if workers is not None else "1"
        if not n.isdigit() or total % max(1, int(n)):
            raise UsageError(f"{o.directive.where}: {o.directive.text!r}: {total} GPU(s) do not divide among "
                             f"{n} task(s); give --gpus-per-task.")
        gpus = (o.directive, str(total // max(1, int(n))))
    elif "gpus" in opts:
        ignored.append(f"--gpus={opts['gpus'].value} ({opts['gpus'].directive.where}; GPUs per task given)")
    return workers, gpus, ignored
