"""benchmarks/soak_checks.py: the evidence the soak's log keeps of a failed in-place or
restart job (the lab's directory, its database with it, is removed after a run that passes)."""

from __future__ import annotations

import sys

from tests import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import soak_checks  # noqa: E402


class FakePg:
    def __init__(self, fail: bool = False) -> None:
        self.fail, self.statements = fail, []

    def sql(self, statement: str, database: str = "postgres") -> str:
        self.statements.append((statement, database))
        if self.fail:
            raise RuntimeError("psql: server closed the connection")
        if "FROM events" in statement:
            return "102.5|worker|worker 0 on local was lost\n101.0|scale|shrink to 1 worker(s)\n"
        return "0|local|failed|3|-9|f\n1|local|exited|3|0|t\n"


class FakeLab:
    def __init__(self, pg: FakePg) -> None:
        self.pg = pg


def test_a_failed_jobs_events_and_workers_are_kept_in_the_log_oldest_first():
    pg = FakePg()
    text = soak_checks.job_events(FakeLab(pg), "soak1", 343)
    assert text.splitlines() == [
        "      event 101.0|scale|shrink to 1 worker(s)", "      event 102.5|worker|worker 0 on local was lost",
        "      worker 0|local|failed|3|-9|f", "      worker 1|local|exited|3|0|t"]
    assert all(db == "soak1" and "job_id = 343" in s for s, db in pg.statements)


def test_evidence_that_cannot_be_read_says_so_and_never_ends_the_summary():
    assert soak_checks.job_events(FakeLab(FakePg(fail=True)), "soak1", 7) == \
        "      (its events could not be read: psql: server closed the connection)"
