"""gpuflex.control.doctor_pg: the command each side of a pair runs, its bounds, and what its
answer becomes (a fake transport: no processes; tests/e2e/ssh/test_doctor.py runs real pairs)."""

from __future__ import annotations

import json

from gpuflex.config import HostConfig
from gpuflex.control import doctor_pg
from gpuflex.errors import TransportError
from gpuflex.hosts.pgcheck import budget_s
from gpuflex.hosts.transport import CommandResult, Transport
from gpuflex.policy.doctor_facts import PgSide, Unanswered


class Answers(Transport):
    """A host that answers every command with `result` (or raises `error`), noting the argv."""

    def __init__(self, host: HostConfig, result: CommandResult | None = None,
                 error: TransportError | None = None) -> None:
        super().__init__(host)
        self.result, self.error, self.argv, self.timeout = result, error, None, None

    def run(self, argv, *, input=None, timeout=None):
        self.argv, self.timeout = argv, timeout
        if self.error is not None:
            raise self.error
        return self.result

    def control_request(self, path, message, timeout=5.0):
        raise AssertionError("not used")


def host(name: str, command_timeout_s: float = 30) -> HostConfig:
    return HostConfig(name=name, address=f"{name}.lab", command_timeout_s=command_timeout_s, python="/opt/py")


def test_either_side_may_start_as_slowly_as_the_slower_host():
    a, b = host("a", 20), host("b", 45)
    assert doctor_pg.start_s(a, b) == doctor_pg.start_s(b, a) == 45
    assert doctor_pg.side_bound(a, b, 10, 2) == budget_s(10, 2, 45)


def test_a_side_runs_pgcheck_with_its_bounds_and_parses_its_line():
    line = {"rank": 1, "stage": "done", "backend": None, "error": None, "results": {"gloo": {"sum": 2.0, "s": 0.25}}}
    t = Answers(host("b"), CommandResult(0, "a warning first\n" + json.dumps(line) + "\n", ""))
    got = doctor_pg.side(t, 1, "a.lab", 29500, 10, 30, ("gloo",))
    assert got == PgSide(1, "done", None, None, (("gloo", 0.25),))
    assert t.argv == ["/opt/py", "-m", "gpuflex.hosts.pgcheck", "--rank", "1", "--addr", "a.lab", "--port", "29500",
                      "--timeout", "10", "--start", "30", "--backends", "gloo", "--budget", f"{budget_s(10, 1, 30):g}"]
    assert t.timeout > budget_s(10, 1, 30)   # pgcheck's watchdog speaks first


def test_a_side_that_printed_no_line_or_could_not_be_reached_is_unanswered():
    silent = doctor_pg.side(Answers(host("b"), CommandResult(127, "", "python: not found")), 0, "x", 1, 5, 5,
                            ("gloo",))
    assert silent == Unanswered("not found: python: not found")
    garbled = doctor_pg.side(Answers(host("b"), CommandResult(0, '{"stage": "done"}', "")), 0, "x", 1, 5, 5,
                             ("gloo",))
    assert isinstance(garbled, Unanswered) and "not a pgcheck line" in garbled.message
    gone = doctor_pg.side(Answers(host("b"), error=TransportError("b", "connection refused")), 0, "x", 1, 5, 5,
                          ("gloo",))
    assert isinstance(gone, Unanswered) and "connection refused" in gone.message


def test_a_pair_whose_port_cannot_be_picked_says_so():
    a = Answers(host("a"), CommandResult(0, "no number\n", ""))
    obs = doctor_pg.run_pair(a, Answers(host("b")), ("gloo",), 10, None)
    assert obs.port is None and obs.port_error == Unanswered("/opt/py printed no port")
