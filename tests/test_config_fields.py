"""gpuflex.config_fields: the checks behind gpuflex.toml's fields, each refusal a message of
its own (tests/test_config.py reads whole files; these hold each field's rule)."""

from __future__ import annotations

import pydantic
import pytest

from gpuflex.config_fields import (MAX_CPU_SLOTS, MAX_URL, MESSAGE, DatabaseUrl, Gpus, HostName, NotifyEvents, Number,
                                   Text, TimeLimit, UserOrGroup, WebhookUrl, check_webhook_url)
from gpuflex.errors import UsageError


def check(kind, value):
    return pydantic.TypeAdapter(kind).validate_python(value)


def refusal(kind, value) -> str:
    with pytest.raises(pydantic.ValidationError) as e:
        check(kind, value)
    error = e.value.errors()[0]
    assert error["type"] == MESSAGE, error
    return error["msg"]


def test_a_number_stays_as_written_and_is_finite():
    assert check(Number, 3) == 3 and isinstance(check(Number, 3), int)
    assert check(Number, 2.5) == 2.5
    assert refusal(Number, True) == "expected int or float, got True."
    assert refusal(Number, "3") == "expected int or float, got '3'."
    assert refusal(Number, float("inf")) == "must be a finite number, got inf."


def test_host_names():
    assert check(HostName, "gpu-01.lab_b") == "gpu-01.lab_b"
    for bad in ("-gpu", "gpu 01", "a" * 64, ""):
        assert refusal(HostName, bad).startswith("invalid host name")


@pytest.mark.parametrize("value", ["all", "cpu:4", [0, 3]])
def test_gpus_are_all_cpu_slots_or_distinct_indices(value):
    assert check(Gpus, value) == value


@pytest.mark.parametrize("value,message", [
    ("cpu:0", 'expected "all", "cpu:N" or a list of GPU indices'),
    ("some", 'expected "all", "cpu:N" or a list of GPU indices'),
    (f"cpu:{MAX_CPU_SLOTS + 1}", f"at most cpu:{MAX_CPU_SLOTS} slots"),
    ("cpu:40000000000000", f"at most cpu:{MAX_CPU_SLOTS} slots"),
    ([], "expected distinct GPU indices"),
    ([0, 0], "expected distinct GPU indices"),
    ([True], "expected distinct GPU indices"),
    ([-1], "expected distinct GPU indices"),
    (4, "expected str or list, got 4."),
])
def test_bad_gpus_are_refused(value, message):
    assert message in refusal(Gpus, value)


def test_text_is_never_blank_nor_holds_a_nul():
    assert check(Text, "~/work") == "~/work"
    assert refusal(Text, "  ") == "must not be empty, got '  '."
    assert refusal(Text, "a\0b") == "must not hold a NUL byte, got 'a\\x00b'."


def test_a_time_limit_is_a_submit_time_spelling_kept_as_written():
    assert check(TimeLimit, "1:30:00") == "1:30:00"
    assert "default_time" in refusal(TimeLimit, "soon")


def test_a_database_url_has_a_scheme():
    assert check(DatabaseUrl, "sqlite:///g.db") == "sqlite:///g.db"
    assert refusal(DatabaseUrl, "g.db").startswith("not a database URL: 'g.db'")


def test_user_and_group_names():
    assert check(UserOrGroup, "@ml-lab") == "@ml-lab" and check(UserOrGroup, "machine$") == "machine$"
    assert refusal(UserOrGroup, "bob smith") == "not a user or @group name: 'bob smith'."


def test_notify_events_are_the_known_ones():
    assert check(NotifyEvents, ["failed", "timeout"]) == ("failed", "timeout")
    assert refusal(NotifyEvents, ["exploded"]).startswith("unknown event 'exploded' (known: succeeded")


def test_a_webhook_is_an_http_url_with_a_host():
    assert check_webhook_url("https://hooks.example.org/x?y=1") == "https://hooks.example.org/x?y=1"
    assert check(WebhookUrl, "http://10.0.0.1:8080/h") == "http://10.0.0.1:8080/h"
    for bad, why in [("ftp://h/x", "give an http:// or https:// URL"), ("https:///x", "give an http://"),
                     ("https://h x", "no spaces or control characters"), ("http://h:99999/", "not a URL"),
                     ("https://h/" + "x" * MAX_URL, "at most 2048 characters")]:
        with pytest.raises(UsageError, match=why):
            check_webhook_url(bad, "--notify")
    assert refusal(WebhookUrl, "ftp://h/x").startswith("'ftp://h/x': give an http://")
