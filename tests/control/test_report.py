"""gpuflex.control.report's moments: the --since/--until of report, acct and harvest."""

from __future__ import annotations

import datetime as dt
import re

import pytest

from gpuflex.control import report
from gpuflex.errors import UsageError

NOW = 1_790_000_000.0


def test_a_duration_counts_back_from_now_and_a_date_is_local_unless_it_names_a_zone():
    assert report.parse_moment("24h", "--since", NOW) == NOW - 86400
    assert report.parse_moment("2026-03-01T08:00+00:00", "--until", NOW) == \
        dt.datetime(2026, 3, 1, 8, tzinfo=dt.timezone.utc).timestamp()
    assert report.parse_moment("2026-03-01", "--since", NOW) == dt.datetime(2026, 3, 1).timestamp()


@pytest.mark.parametrize("text", ["0001-01-01", "9999999999999d", "1969-12-31T00:00+00:00"])
def test_a_moment_before_1970_or_past_time_t_is_one_usage_line(text):
    for option in ("--since", "--until"):
        with pytest.raises(UsageError, match="^" + re.escape(f"{option} '{text}' reaches back before 1970-01-01; give a later")):
            report.moment_since_1970(text, option, NOW)
    with pytest.raises(UsageError, match="reaches back before 1970-01-01"):
        report.parse_since(text, NOW)


def test_since_is_in_the_past_while_any_moment_may_be_in_the_future():
    assert report.moment_since_1970("2999-01-01", "--until", NOW) > NOW
    with pytest.raises(UsageError, match="^--since '2999-01-01' is in the future."):
        report.parse_since("2999-01-01", NOW)
    assert report.parse_since("1h", NOW) == NOW - 3600


def test_anything_else_names_what_is_expected():
    with pytest.raises(UsageError, match=r"expected a duration \(24h, 7d\) or an ISO date/time"):
        report.parse_moment("yesterday", "--since", NOW)
