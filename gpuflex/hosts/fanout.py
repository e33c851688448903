"""Run one function per host in parallel: a result *or* an error per host, never a stop at
the first failure, and never longer than the timeout (a hung host is reported, not waited
for).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from typing import Callable, Generic, Iterable, TypeVar

from gpuflex.config import HostConfig
from gpuflex.errors import CommandTimeout, GpuflexError, TransportError

T = TypeVar("T")
log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Result(Generic[T]):
    """What one host gave: `value`, or the `error` that stopped it."""

    host: str
    value: T | None = None
    error: GpuflexError | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def unwrap(self) -> T:
        """The value; raises the host's error."""
        if self.error is not None:
            raise self.error
        return self.value  # type: ignore[return-value]


def fan_out(hosts: Iterable[HostConfig], fn: Callable[[HostConfig], T],
            timeout: float) -> dict[str, Result[T]]:
    """`fn(host)` for every host at once; returns {host name: Result} in the hosts' order.

    An exception from `fn` becomes that host's error (a `TransportError` as raised; any
    other exception wrapped into one, so a bug on one host does not hide the others). A
    host still running after `timeout` seconds gets a TransportError; its thread is a
    daemon and is abandoned (its own connect/command timeouts end it later).
    """
    hosts = list(hosts)
    return run_bounded({h.name: functools.partial(fn, h) for h in hosts}, timeout)


def run_bounded(tasks: dict[str, Callable[[], T]], timeout: float) -> dict[str, Result[T]]:
    """Every task at once, each in a thread of its own; {key: Result} in the tasks' order.

    The same rules as `fan_out`, with any key (a host, a host's check, a pair of hosts):
    an exception becomes that key's error, a task still running after `timeout` seconds
    gets "no answer within N s" and is abandoned (a daemon thread; its own timeouts end it).
    """
    results: dict[str, Result[T]] = {}
    lock = threading.Lock()
    done = threading.Condition(lock)

    def work(key: str, fn: Callable[[], T]) -> None:
        try:
            res: Result[T] = Result(key, value=fn())
        except GpuflexError as e:
            res = Result(key, error=e)
        except Exception as e:  # noqa: BLE001 - reported per key, see docstring
            log.debug("%s: unexpected error", key, exc_info=True)  # the traceback, for --verbose
            res = Result(key, error=TransportError(key, f"{type(e).__name__}: {e}"))
        with done:
            results.setdefault(key, res)
            done.notify_all()

    deadline = time.monotonic() + timeout
    for key, fn in tasks.items():
        threading.Thread(target=work, args=(key, fn), name=f"gpuflex-fanout-{key}", daemon=True).start()
    with done:
        while len(results) < len(tasks):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            done.wait(left)
        for key in tasks:
            if key not in results:
                results[key] = Result(key, error=CommandTimeout(key, f"no answer within {timeout:g} s", timeout))
        return {key: results[key] for key in tasks}
