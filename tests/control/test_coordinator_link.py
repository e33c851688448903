"""gpuflex.control.coordinator_link: one request to a job's coordinator over its control
socket, with a transport that answers as told (no processes, no sockets)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from gpuflex.control import coordinator_link
from gpuflex.errors import JobError, TransportError


class Transport:
    def __init__(self, replies: list) -> None:
        self.replies, self.asked = replies, []

    def control_request(self, path: str, message: dict) -> dict:
        self.asked.append((path, message))
        reply = self.replies.pop(0)
        if isinstance(reply, Exception):
            raise reply
        return reply


def link(replies: list) -> tuple[Transport, SimpleNamespace, SimpleNamespace]:
    t = Transport(replies)
    pool = SimpleNamespace(transport=lambda host: t)
    job = SimpleNamespace(id=7, store_host="local", store_pgid=None, socket_dir="/run/gf/7")
    return t, pool, job


def test_a_request_reaches_the_coordinators_socket_and_returns_its_reply():
    t, pool, job = link([{"ok": True, "generation": 3}])
    assert coordinator_link.request(None, pool, job, {"op": "status"}) == {"ok": True, "generation": 3}
    assert t.asked == [("/run/gf/7/coord.sock", {"op": "status"})]


def test_a_refusal_is_a_job_error_naming_the_op_and_the_reason():
    _, pool, job = link([{"ok": False, "error": "members must be worker ids"}])
    with pytest.raises(JobError, match="job 7: coordinator refused resize: members must be worker ids"):
        coordinator_link.request(None, pool, job, {"op": "resize"})


def test_no_answer_from_a_coordinator_not_known_to_run_is_raised_at_once():
    t, pool, job = link([TransportError("local", "no such socket"), {"ok": True}])
    with pytest.raises(TransportError, match="^local: cannot reach job 7's coordinator: no such socket$"):
        coordinator_link.request(None, pool, job, {"op": "status"}, wait_s=30)
    assert len(t.asked) == 1   # no pgid: it cannot be told alive, so no retry
    assert coordinator_link.coordinator_process(None, pool, job) == (False, None)
