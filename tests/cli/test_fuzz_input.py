"""Bad input, fuzzed: generated command lines and broken configs, each refused the same way.

Every generated case must exit 2 with exactly one stderr line that starts `error:`, print
nothing on stdout, raise no traceback, and leave the database as it was (its rows dumped
before and after). The few valid lines the generator makes on purpose must exit 0.

The generators are seeded (the seed is in the test id: rerun one with `-k seed_16`) and
bounded: 3 x 50 command lines and 2 x 20 configs, all in-process (typer's CliRunner).
They mutate valid input: values too large for the database or for time_t, Unicode digits,
empty and blank strings, bytes that are not UTF-8 (as Python hands them over:
surrogate escapes), NUL bytes, rich markup, unknown options, dropped and extra
arguments, options out of order; configs get wrong types, huge numbers, empty strings,
unknown keys and tables of the wrong shape. Each value in a pool is invalid for every
slot it is drawn for, so each generated case has a known verdict.
"""

from __future__ import annotations

import json
import math
import random
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import GpuflexCLI, cleanup_jobs, db_dump
from tests.cli.test_bad_input import assert_rejected, make_run, seeded  # noqa: F401 (seeded: a fixture)

CLI_SEEDS = [16, 1601, 20261123]
CLI_CASES_PER_SEED = 50
CONFIG_SEEDS = [6, 86]
CONFIG_CASES_PER_SEED = 20
HANG_GUARD_S = 120   # a case that is accepted by mistake may loop (watch): end it, fail the test

HUGE = ["10000000000000000000000000", "2147483648", "-2147483649", "9" * 400, "9" * 5000]
UNICODE_DIGITS = ["²", "٣", "１２", "߁", "৩"]
NOT_UTF8 = ["\udcff", "a\udcfeb", "\udcc3\udc28"]
ODD = ["", " ", "\n", "a\x00b", "[red]x", "[/x]", "x", "1 2", "-", "--"]

# per slot: values every one of which the slot must refuse
POOLS: dict[str, list[str]] = {
    "workers": HUGE + UNICODE_DIGITS + NOT_UTF8 + ODD + ["0", "-1", "3:1", "65537", "1:65537", "1.5", "nan"],
    "count": HUGE + UNICODE_DIGITS[:1] + NOT_UTF8 + ODD + ["0", "-1", "1.5", "nan", "inf", "4097"],
    "signed": HUGE + UNICODE_DIGITS[:1] + NOT_UTF8 + ODD + ["1.5", "nan", "inf", "1e3"],
    "retries": HUGE + NOT_UTF8 + ODD + ["-1", "1001", "1.5"],
    "ticks": HUGE + NOT_UTF8 + ODD + ["0", "-1", "1.5", "nan", "²", "1000001"],
    "jobref": HUGE + UNICODE_DIGITS + NOT_UTF8 + ["", " ", "a b", "[/x]", "a\x00b", "-", "x" * 65, "0", "42"],
    "seconds": HUGE + NOT_UTF8 + ["", "x", "0", "0.1", "-1", "nan", "inf", "-inf", "1e10", "1e400", "86401", "²"],
    "duration": HUGE[:1] + NOT_UTF8 + ["", "x", "0", "0s", "-1", "9999999999999d", "1e10", "10w10", "2 mi", "nan"],
    "since": NOT_UTF8 + ["", "x", "9999999999999d", "1" * 40 + "w", "0001-01-01", "1900-01-01", "2999-01-01",
                         "0d", "-3d", "2026-13-01", "nan"],
    "name": NOT_UTF8 + ["", " ", "a b", "[/x]", "1", "007", "x" * 65, "-x", "a\x00b", ".x", "²"],
    "env": NOT_UTF8 + ["FOO", "=x", "1X=2", "A B=1", "FOO\x00=1", "A=\udcff", "A=b\x00c", "É=1"],
    "workdir": NOT_UTF8 + ["", "/nonexistent/gpuflex", "a\x00b"],
    "argv": NOT_UTF8 + ["", " ", "a\x00b"],
    "argv_rest": NOT_UTF8 + ["a\x00b"],   # after the program any text is an argument, "" too
}

# (argv template, slot kind): "{}" is where a value from the slot's pool goes
TEMPLATES: list[tuple[list[str], str]] = [
    (["submit", "--workers", "{}", "--", "true"], "workers"),
    (["submit", "--gpus-per-worker", "{}", "--", "true"], "count"),
    (["submit", "--priority", "{}", "--", "true"], "signed"),
    (["submit", "--retries", "{}", "--", "true"], "retries"),
    (["submit", "--name", "{}", "--", "true"], "name"),
    (["submit", "--env", "{}", "--", "true"], "env"),
    (["submit", "--workdir", "{}", "--", "true"], "workdir"),
    (["submit", "--", "{}"], "argv"),
    (["submit", "--", "true", "{}"], "argv_rest"),
    (["status", "{}"], "jobref"),
    (["status", "{}", "--json"], "jobref"),
    (["cancel", "{}"], "jobref"),
    (["events", "{}"], "jobref"),
    (["logs", "{}"], "jobref"),
    (["scale", "{}", "2"], "jobref"),
    (["scale", "1", "{}"], "count"),
    (["scale", "1", "2", "--wait", "--timeout", "{}"], "seconds"),
    (["status", "1", "--watch", "--interval", "{}"], "seconds"),
    (["status", "--watch", "--json", "--interval", "{}"], "seconds"),
    (["watch", "--ticks", "1", "--interval", "{}"], "duration"),
    (["watch", "--ticks", "{}"], "ticks"),
    (["report", "--since", "{}"], "since"),
    (["report", "--json", "--since", "{}"], "since"),
]

# valid command lines, read-only on the seeded DB: some of these are made on purpose
VALID: list[list[str]] = [["status"], ["status", "1", "--json"], ["status", "done"], ["events", "1"],
                          ["status", "--interval", "5"], ["report", "--since", "30d", "--json"]]

UNKNOWN_OPTIONS = ["--wokers", "--bogus", "--bogus=1", "-Z", "--json=1", "--\udcff", "--ïnterval"]


def _fill(template: list[str], value: str) -> list[str]:
    return [value if a == "{}" else a for a in template]


def generate_command_lines(seed: int, n: int) -> list[tuple[list[str], int]]:
    """`n` (argv, expected exit code) pairs from `seed`."""
    rng = random.Random(seed)
    cases: list[tuple[list[str], int]] = []
    while len(cases) < n:
        template, slot = rng.choice(TEMPLATES)
        kind = rng.random()
        if kind < 0.08:
            cases.append((list(rng.choice(VALID)), 0))
        elif kind < 0.65:
            cases.append((_fill(template, rng.choice(POOLS[slot])), 2))
        elif kind < 0.75:   # an unknown option among the options (before any '--')
            argv = _fill(template, "1")
            end = argv.index("--") if "--" in argv else len(argv)
            at = rng.randint(1, end)
            if at < end and argv[at - 1].startswith("--"):
                at -= 1       # never between an option and its value (the option would take it)
            cases.append((argv[:at] + [rng.choice(UNKNOWN_OPTIONS)] + argv[at:], 2))
        elif kind < 0.83:   # options before the command's name, or a misspelt command
            argv = _fill(template, "1")
            if len(argv) > 2 and argv[1].startswith("--"):
                cases.append(([argv[1], argv[2], argv[0], *argv[3:]], 2))
            else:
                cases.append(([argv[0][:-1] + "x", *argv[1:]], 2))
        elif kind < 0.91:   # a required argument left out
            cases.append((rng.choice([["cancel"], ["events"], ["logs"], ["scale"], ["scale", "1"],
                                      ["submit", "--workers"], ["status", "--interval"],
                                      ["report", "--since"], ["hosts", "trust"]]), 2))
        else:               # one argument too many, or two values at once
            cases.append((rng.choice([["hold", "1", "99"], ["events", "1", "x"], ["status", "1", "2"],
                                      ["scale", "1", "2", "3"], ["report", "--json", "--csv"],
                                      ["db", "upgrade", "now"], ["logs", "1", "--worker", "x"]]), 2))
    return cases


def _alarm(signum, frame):
    raise TimeoutError(f"a generated command ran past {HANG_GUARD_S} s")


@pytest.fixture
def run_guarded(home, seeded, db_path):  # noqa: F811 (seeded: the fixture imported above)
    """The in-process CLI with a hang guard; cancels and kills whatever a case started by mistake."""
    run = make_run("clirunner", home)
    old = signal.signal(signal.SIGALRM, _alarm)

    def guarded(config: Path, *args: str):
        signal.alarm(HANG_GUARD_S)
        try:
            return run(config, *args)
        finally:
            signal.alarm(0)

    yield guarded
    signal.signal(signal.SIGALRM, old)
    cleanup_jobs(GpuflexCLI(home, seeded), db_path)


@pytest.mark.parametrize("seed", CLI_SEEDS, ids=[f"seed_{s}" for s in CLI_SEEDS])
def test_generated_command_lines(run_guarded, seeded, db_path, seed):  # noqa: F811
    print(f"seed {seed}")
    failures = []
    for argv, expected in generate_command_lines(seed, CLI_CASES_PER_SEED):
        before = db_dump(db_path)
        code, out, err = result = run_guarded(seeded, *argv)
        try:
            if expected == 0:
                assert code == 0 and "Traceback" not in out + err and "error:" not in err, (code, err)
            else:
                assert_rejected(result)
                assert db_dump(db_path) == before, "the database changed"
        except AssertionError as e:
            failures.append(f"{argv!r}: {e}".splitlines()[0][:300])
    assert failures == [], f"seed {seed}: {len(failures)} case(s) failed:\n" + "\n".join(failures)


def test_the_generator_is_deterministic_bounded_and_mixes_valid_and_invalid_lines():
    a, b = generate_command_lines(16, CLI_CASES_PER_SEED), generate_command_lines(16, CLI_CASES_PER_SEED)
    assert a == b and len(a) == CLI_CASES_PER_SEED
    assert generate_command_lines(1601, CLI_CASES_PER_SEED) != a
    every = [c for s in CLI_SEEDS for c in generate_command_lines(s, CLI_CASES_PER_SEED)]
    assert {code for _, code in every} == {0, 2}
    # a case that would run a job or watch forever were its value accepted is never "valid"
    assert not any(code == 0 and (argv[0] in ("submit", "watch") or "--watch" in argv) for argv, code in every)


# ---- broken configs ------------------------------------------------------------------------------
NUMBER_KEYS = [("harvest", "interval_s"), ("harvest", "idle_util_pct"), ("harvest", "idle_memory_mib"),
               ("harvest", "idle_samples"), ("harvest", "reclaim_deadline_s"), ("jobs", "cancel_grace_s"),
               ("jobs", "checkpoint_interval_s"), ("jobs", "pg_timeout_s"), ("jobs", "heartbeat_timeout_s"),
               ("jobs", "max_same_failures"), ("hosts", "port"), ("hosts", "connect_timeout_s"),
               ("hosts", "command_timeout_s"), ("hosts", "cpus")]
STRING_KEYS = [("hosts", "address"), ("hosts", "workdir"), ("hosts", "python"), ("hosts", "nvidia_smi"),
               ("hosts", "known_hosts"), ("hosts", "user"), ("hosts", "owner"), ("hosts", "identity_file"),
               ("hosts", "name"), ("database", "url")]
BAD_NUMBERS: list[Any] = [1e10, 10**12, 10**25, -1, -1e10, math.nan, math.inf, -math.inf, "5", True, [1], {"a": 1}]
BAD_STRINGS: list[Any] = ["", "   ", "\t", "a\x00b", 5, 1.5, False, [], {"a": "b"}]
BAD_GPUS: list[Any] = ["", "cpu:0", "cpu:999999", "gpu", [-1], [10**12], [0, 0], [], [True], 1.0]
BAD_TABLES: list[tuple[str, Any]] = [("jobs", 3), ("harvest", "x"), ("database", []), ("hosts", []),
                                     ("hosts", {"name": "local"}), ("hosts", [1]), ("jobs", [{"a": 1}])]


def valid_config(home: Path) -> dict[str, Any]:
    return {"database": {"url": f"sqlite:///{home}/fz.db"},
            "jobs": {"cancel_grace_s": 3}, "harvest": {"interval_s": 60},
            "hosts": [{"name": "local", "address": "local", "gpus": "cpu:2", "workdir": str(home / "work")}]}


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return json.dumps(v)   # a TOML basic string; \u0000 is valid TOML
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return "{" + ", ".join(f"{json.dumps(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"


def to_toml(doc: dict[str, Any]) -> str:
    """The few shapes the generator makes: tables of scalars, an array of host tables, or a
    table given as a plain value (`jobs = 3`)."""
    lines = []
    for name, value in doc.items():
        if isinstance(value, dict):
            lines.append(f"[{name}]")
            lines += [f"{json.dumps(k)} = {_toml_value(v)}" for k, v in value.items()]
        elif name == "hosts" and isinstance(value, list) and value and all(isinstance(h, dict) for h in value):
            for h in value:
                lines.append("[[hosts]]")
                lines += [f"{json.dumps(k)} = {_toml_value(v)}" for k, v in h.items()]
        else:
            lines.insert(0, f"{name} = {_toml_value(value)}")   # before any table header
    return "\n".join(lines) + "\n"


def _has(doc: dict[str, Any], table: str) -> bool:
    """Whether `table` is still a table (hosts: an array of them) after an earlier fault."""
    if table == "hosts":
        hosts = doc.get("hosts")
        return isinstance(hosts, list) and bool(hosts) and isinstance(hosts[0], dict)
    return isinstance(doc.get(table, {}), dict)


def _set(doc: dict[str, Any], table: str, key: str, value: Any) -> None:
    (doc["hosts"][0] if table == "hosts" else doc.setdefault(table, {}))[key] = value


def generate_configs(seed: int, n: int, home: Path) -> list[tuple[str, str]]:
    """`n` (TOML text, what was broken) pairs from `seed`, each with one or two faults."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        doc, what = valid_config(home), []
        for _ in range(rng.choice([1, 1, 2])):
            kind = rng.random()
            if kind < 0.35:
                table, key = rng.choice(NUMBER_KEYS)
                value = rng.choice(BAD_NUMBERS)
            elif kind < 0.65:
                table, key = rng.choice(STRING_KEYS)
                value = rng.choice(BAD_STRINGS)
            elif kind < 0.75:
                table, key, value = "hosts", "gpus", rng.choice(BAD_GPUS)
            elif kind < 0.85:
                table, value = rng.choice(BAD_TABLES)
                doc[table], key = value, ""
                what.append(f"{table} = {value!r}")
                continue
            elif kind < 0.93:
                table, key, value = rng.choice(["database", "jobs", "harvest", "hosts"]), "colour", 1
            else:
                if _has(doc, "hosts"):
                    doc["hosts"].append(dict(doc["hosts"][0]))   # a duplicate host name
                    what.append("duplicate host")
                continue
            if _has(doc, table):
                _set(doc, table, key, value)
            what.append(f"{table}.{key} = {value!r}")
        out.append((to_toml(doc), "; ".join(what)))
    return out


CONFIG_COMMANDS = [["status"], ["cancel", "1"], ["submit", "--", "true"], ["report"], ["hosts"],
                   ["watch", "--ticks", "1"], ["db", "upgrade"], ["events", "x"]]


@pytest.mark.parametrize("seed", CONFIG_SEEDS, ids=[f"seed_{s}" for s in CONFIG_SEEDS])
def test_generated_broken_configs(home, seed):
    print(f"seed {seed}")
    run = make_run("clirunner", home)
    rng = random.Random(seed)
    failures = []
    for i in range(CONFIG_CASES_PER_SEED):
        where = home / f"case{i}"   # each its own DB path: one accepted by mistake spoils no other
        where.mkdir()
        text, what = generate_configs(seed, CONFIG_CASES_PER_SEED, where)[i]
        path = where / "broken.toml"
        path.write_text(text)
        argv = rng.choice(CONFIG_COMMANDS)
        try:
            line = assert_rejected(run(path, *argv))
            assert str(path) in line or "TOML" in line, line
            made = sorted(p.name for p in where.iterdir() if p != path)
            assert made == [], f"files made: {made}"
        except AssertionError as e:
            failures.append(f"{what} ({argv!r}): {e}".splitlines()[0][:300])
    assert failures == [], f"seed {seed}: {len(failures)} config(s) failed:\n" + "\n".join(failures)


def test_the_valid_config_the_generator_starts_from_is_accepted(home):
    path = home / "ok.toml"
    path.write_text(to_toml(valid_config(home)))
    code, out, err = make_run("clirunner", home)(path, "status", "--json")
    assert (code, json.loads(out)) == (0, []), err
