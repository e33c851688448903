"""Run one function per host in parallel: a result *or* an error per host, never a stop at
the first failure, and never longer than the timeout (a hung host is reported, not waited
for).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Callable, Generic, Iterable, TypeVar

from gpuflex.config import HostConfig
from gpuflex.errors import GpuflexError, TransportError

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
    results: dict[str, Result[T]] = {}
    lock = threading.Lock()
    done = threading.Condition(lock)

    def work(h: HostConfig) -> None:
        try:
            res: Result[T] = Result(h.name, value=fn(h))
        except GpuflexError as e:
            res = Result(h.name, error=e)
        except Exception as e:  # noqa: BLE001 - reported per host, see docstring
            log.debug("%s: unexpected error", h.name, exc_info=True)  # the traceback, for --verbose
            res = Result(h.name, error=TransportError(h.name, f"{type(e).__name__}: {e}"))
        with done:
            results.setdefault(h.name, res)
            done.notify_all()

    deadline = time.monotonic() + timeout
    for h in hosts:
        threading.Thread(target=work, args=(h,), name=f"gpuflex-fanout-{h.name}", daemon=True).start()
    with done:
        while len(results) < len(hosts):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            done.wait(left)
        for h in hosts:
            if h.name not in results:
                results[h.name] = Result(h.name, error=TransportError(
                    h.name, f"no answer within {timeout:g} s"))
        return {h.name: results[h.name] for h in hosts}
