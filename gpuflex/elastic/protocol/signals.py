"""The requests that reach a training step from outside it: stop, checkpoint, poke.

They arrive on other threads (a SIGTERM handler, the control socket's server threads)
and are only flags: the training thread reads them at the next step boundary, where the
members agree on them, so no request ever touches training state mid-step.
"""

from __future__ import annotations

import threading

# what asked a worker to stop (`StepSignals.stop_by`, keys.STOPPED's `by`): the only texts the
# coordinator passes on from that record
BY_SIGTERM = "a SIGTERM"
BY_CONTROL_SOCKET = "its control socket's stop"
STOP_ASKERS = (BY_SIGTERM, BY_CONTROL_SOCKET)


class StepSignals:
    """Flags set from any thread and read at step boundaries."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self.stop_by: str | None = None   # what asked this worker to stop (the first request)
        self._checkpoint = threading.Event()
        self._poke = threading.Event()   # look at the store's latest generation now

    def request_stop(self, by: str) -> None:
        """`by`: what asked (one of STOP_ASKERS), for the job's reason."""
        if self.stop_by is None:
            self.stop_by = by
        self._stop.set()

    def request_checkpoint(self) -> None:
        self._checkpoint.set()

    def poke(self) -> None:
        self._poke.set()

    def stop_requested(self) -> bool:
        """Stays true once set: the run winds down at the next boundary."""
        return self._stop.is_set()

    def take_checkpoint(self) -> bool:
        """Whether a checkpoint was requested since the last call."""
        wanted = self._checkpoint.is_set()
        self._checkpoint.clear()
        return wanted

    def take_poke(self) -> bool:
        """Whether a poke came since the last call."""
        if self._poke.is_set():
            self._poke.clear()
            return True
        return False
