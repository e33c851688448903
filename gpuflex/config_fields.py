"""The checks behind gpuflex.toml's fields (gpuflex.config's tables use them as pydantic
validators): numbers, host names, GPU lists, paths and commands, time limits, database
and webhook URLs, user and group names. Each refusal is a PydanticCustomError of kind
MESSAGE whose text `gpuflex.config._config_error` shows as it is, after the file and the
key. `check_webhook_url` also checks `submit --notify` (a UsageError there).
"""

from __future__ import annotations

import math
import re
import urllib.parse
from typing import Annotated, Any, Callable, Union

from pydantic import AfterValidator, BeforeValidator, PlainValidator, StrictStr
from pydantic_core import PydanticCustomError

from gpuflex.errors import UsageError

MAX_CPU_SLOTS = 4096  # each slot is a DB row: a typo like cpu:40000000 must not hang every command
MESSAGE = "gpuflex_config"  # our own errors carry the whole message (see gpuflex.config._config_error)


def invalid(message: str) -> PydanticCustomError:
    """A refusal shown as `message` after the file and the key."""
    return PydanticCustomError(MESSAGE, "{message}", {"message": message})


def _number(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise invalid(f"expected int or float, got {value!r}.")
    if not math.isfinite(value):  # TOML allows inf and nan
        raise invalid(f"must be a finite number, got {value!r}.")
    return value


def _matching(pattern: str, message: str) -> Callable[[str], str]:
    """A check that the whole value matches `pattern`; `message` names it ({value!r})."""
    def check(value: str) -> str:
        if not re.fullmatch(pattern, value):
            raise invalid(message.format(value=value))
        return value
    return check


_host_name = _matching(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}", "invalid host name {value!r} (letters, digits, . _ -).")


def _gpus(value: Any) -> Any:
    if isinstance(value, str):
        if value != "all" and not re.fullmatch(r"cpu:[1-9][0-9]*", value):
            raise invalid(f'expected "all", "cpu:N" or a list of GPU indices, got {value!r}.')
        if value != "all" and (len(value) > 12 or int(value[4:]) > MAX_CPU_SLOTS):
            raise invalid(f"at most cpu:{MAX_CPU_SLOTS} slots, got {value!r}.")
        return value
    if not isinstance(value, list):
        raise invalid(f"expected str or list, got {value!r}.")
    if not value or not all(isinstance(g, int) and not isinstance(g, bool) and 0 <= g < MAX_CPU_SLOTS
                            for g in value) or len(set(value)) != len(value):
        raise invalid(f"expected distinct GPU indices from 0 to {MAX_CPU_SLOTS - 1}, got {value!r}.")
    return value


def _text(value: str) -> str:
    """A path, command or address: never blank (an empty `workdir` or `python` would fail
    on the host at the first launch, long after the mistake), never a NUL byte."""
    if not value.strip():
        raise invalid(f"must not be empty, got {value!r}.")
    if "\0" in value:
        raise invalid(f"must not hold a NUL byte, got {value!r}.")
    return value


def _time_limit(value: str) -> str:
    """A `--time` spelling (gpuflex.jobspec.parse_time), kept as written."""
    from gpuflex.jobspec import parse_time

    try:
        parse_time(value, "default_time")
    except UsageError as e:
        raise invalid(str(e)) from None
    return value


def _database_url(value: str) -> str:
    if "://" not in value or "\0" in value:
        raise invalid(f"not a database URL: {value!r} (e.g. sqlite:///path/gpuflex.db).")
    return value


# int or float as written (an int stays an int), finite; never a bool
Number = Annotated[Union[int, float], BeforeValidator(_number)]
HostName = Annotated[StrictStr, AfterValidator(_host_name)]
Text = Annotated[StrictStr, AfterValidator(_text)]
Gpus = Annotated[Union[str, list[int]], PlainValidator(_gpus)]  # "all", "cpu:N" or [indices]
TimeLimit = Annotated[StrictStr, AfterValidator(_time_limit)]
DatabaseUrl = Annotated[StrictStr, AfterValidator(_database_url)]


# what a job's owner can hear of by webhook (gpuflex.control.notify); `[notify] events`
NOTIFY_EVENTS = ("succeeded", "failed", "timeout", "preempted", "cancelled")
MAX_URL = 2048


def check_webhook_url(url: str, option: str = "--notify") -> str:
    """`url` if it is an http(s) URL with a host and no spaces or control characters;
    UsageError naming the option and the URL otherwise (checked before anything is written)."""
    shown = url if len(url) <= 80 else url[:77] + "..."
    if len(url) > MAX_URL or any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in url):
        raise UsageError(f"{option} {shown!r}: a URL holds no spaces or control characters (at most "
                         f"{MAX_URL} characters); e.g. https://hooks.example.org/gpuflex.")
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port   # raises ValueError for a port that is no number or out of range
    except ValueError as e:
        raise UsageError(f"{option} {shown!r}: not a URL ({e}).") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UsageError(f"{option} {shown!r}: give an http:// or https:// URL with a host, "
                         "e.g. https://hooks.example.org/gpuflex.")
    return url


def _notify_url(value: str) -> str:
    try:
        return check_webhook_url(value, "")
    except UsageError as e:
        raise invalid(str(e).lstrip()) from None


def _notify_events(value: tuple[str, ...]) -> tuple[str, ...]:
    for name in value:
        if name not in NOTIFY_EVENTS:
            raise invalid(f"unknown event {name!r} (known: {', '.join(NOTIFY_EVENTS)}).")
    return value


_user_or_group = _matching(r"@?[A-Za-z_][A-Za-z0-9_.-]{0,63}\$?", "not a user or @group name: {value!r}.")


UserOrGroup = Annotated[StrictStr, AfterValidator(_user_or_group)]
WebhookUrl = Annotated[StrictStr, AfterValidator(_notify_url)]
NotifyEvents = Annotated[tuple[StrictStr, ...], AfterValidator(_notify_events)]
