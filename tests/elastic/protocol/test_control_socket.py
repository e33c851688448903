"""The control socket under hostile peers (issue 16, item 7): deeply nested JSON gets an
error reply (no RecursionError), a client trickling bytes is cut off per request, slow
clients cannot lock `status` out, and a coordinator's `resize` names only the job's
workers. Real unix sockets; every wait is bounded."""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import time

import pytest

from gpuflex.elastic.protocol import control_socket as control
from gpuflex.elastic.protocol.control_socket import MAX_CLIENTS, MAX_DEPTH, MAX_LINE, REQUEST_TIMEOUT_S, ControlServer, too_deep
from gpuflex.elastic.coordinator.main import Coordinator
from gpuflex.elastic.coordinator.failures import NEWCOMER_SPAN, check_members
from gpuflex.elastic.coordinator.generations import Generations
from gpuflex.hosts.relay import unix_exchange
from tests.fakes.store_fake import Clock, FakeStore

BOUND_S = 20   # far above every deadline under test: only a hang reaches it


@pytest.fixture
def sock_dir():
    d = tempfile.mkdtemp(prefix="gfx-", dir="/tmp")   # unix socket paths must stay short
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def server(sock_dir):
    path = os.path.join(sock_dir, "ctl", "c.sock")
    srv = ControlServer(path, {"status": lambda msg: {"step": 3}})
    yield path
    srv.close()


def talk(path: str, payload: bytes) -> dict:
    return json.loads(unix_exchange(path, payload, BOUND_S))


def connect(path: str, first: bytes = b'{"op": "sta') -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(BOUND_S)
    s.connect(path)
    s.sendall(first)
    return s


def nested(depth: int) -> bytes:
    return b'{"op": "status", "x": ' + b"[" * depth + b"]" * depth + b"}\n"


# ---- the parser ----------------------------------------------------------------------------
def test_deep_nesting_gets_an_error_reply_and_the_server_keeps_serving(server):
    payload = nested((MAX_LINE - 100) // 2)
    reply = talk(server, payload)
    assert reply["ok"] is False and "nested deeper" in reply["error"]
    assert talk(server, b'{"op": "status"}\n') == {"ok": True, "step": 3}


def test_nesting_up_to_the_limit_is_served_and_brackets_in_strings_do_not_count(server):
    assert talk(server, nested(MAX_DEPTH - 1))["ok"] is True
    assert talk(server, nested(MAX_DEPTH + 1))["ok"] is False
    quoted = b'{"op": "status", "x": "' + b"[{" * 5000 + b'\\"]"}\n'
    assert talk(server, quoted) == {"ok": True, "step": 3}


@pytest.mark.parametrize("text,deep", [
    (b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1), True),
    (b"[" * MAX_DEPTH + b"]" * MAX_DEPTH, False),
    (b"[]" * 10_000, False),                                  # many, but flat
    (b'["' + b"[" * 1000 + b'"]', False),                     # inside a string
    (b'["\\"' + b"[" * 1000 + b'"]', False),                  # after an escaped quote, still a string
    (b'["\\\\"' + b", [" * (MAX_DEPTH + 1) + b"]", True),     # an escaped backslash ends the string
])
def test_too_deep_counts_only_structure(text, deep):
    assert too_deep(text) is deep


def test_a_recursion_error_in_the_parser_is_an_error_reply(server, monkeypatch):
    class Recursing:
        dumps = staticmethod(json.dumps)

        @staticmethod
        def loads(_line):
            raise RecursionError("maximum recursion depth exceeded")
    monkeypatch.setattr(control, "json", Recursing)
    reply = talk(server, b'{"op": "status"}\n')
    assert reply["ok"] is False and "nested too deeply" in reply["error"]


# ---- slow peers ----------------------------------------------------------------------------
def test_a_client_trickling_a_byte_at_a_time_is_cut_off_per_request(server):
    """A byte every 0.5 s never lets a single read time out; the whole request must still
    arrive within REQUEST_TIMEOUT_S of the first byte: the server answers and closes while
    the client is still trickling (a per-read timeout would let it trickle for 30 s)."""
    s = connect(server, b"{")
    got, cut_off = b"", False
    try:
        for c in b'"op": "status", "pad": "' + b"x" * 60:
            time.sleep(0.5)
            try:
                s.sendall(bytes([c]))
                s.settimeout(0.01)
                got += s.recv(65536)
            except socket.timeout:
                continue
            except OSError:
                pass                  # closed by the server
            cut_off = True
            break
        s.settimeout(BOUND_S)
        got += b"" if got else s.recv(65536)
    finally:
        s.close()
    assert cut_off, "the server let a trickling client hold its slot"
    reply = json.loads(got.splitlines()[0])
    assert reply["ok"] is False and "timeout" in reply["error"]


def test_an_idle_connection_is_closed_after_the_request_deadline(server):
    s = connect(server, b"")
    try:
        reply = json.loads(s.recv(65536).splitlines()[0])
        assert reply["ok"] is False and "timeout" in reply["error"]
        assert s.recv(65536) == b""   # and closed
    finally:
        s.close()


def test_many_requests_on_one_connection_each_get_their_own_deadline(server):
    s = connect(server, b"")
    try:
        for _ in range(3):
            time.sleep(REQUEST_TIMEOUT_S * 0.6)   # together longer than one deadline
            s.sendall(b'{"op": "status"}\n')
            assert json.loads(s.recv(65536)) == {"ok": True, "step": 3}
    finally:
        s.close()


def test_slow_clients_holding_every_slot_do_not_lock_out_status(server):
    slow = [connect(server) for _ in range(MAX_CLIENTS)]
    try:
        time.sleep(control.EVICT_AFTER_S + 0.2)
        for _ in range(3):   # each request takes the slot of the slowest peer
            assert talk(server, b'{"op": "status"}\n') == {"ok": True, "step": 3}
        slow += [connect(server) for _ in range(MAX_CLIENTS)]   # more after them
        time.sleep(control.EVICT_AFTER_S + 0.2)
        assert talk(server, b'{"op": "status"}\n') == {"ok": True, "step": 3}
        evicted = slow[0].recv(65536)
        assert evicted == b"" or not json.loads(evicted.splitlines()[0])["ok"]
    finally:
        for s in slow:
            s.close()


def test_a_full_server_without_slow_peers_answers_busy(server, monkeypatch):
    """Peers that have only just connected are not evicted: the newcomer is told busy."""
    monkeypatch.setattr(control, "EVICT_AFTER_S", BOUND_S)
    slow = [connect(server) for _ in range(MAX_CLIENTS)]
    try:
        time.sleep(0.2)
        reply = talk(server, b'{"op": "status"}\n')
        assert reply["ok"] is False and "busy" in reply["error"]
    finally:
        for s in slow:
            s.close()


# ---- resize members ------------------------------------------------------------------------
@pytest.fixture
def coordinator_socket(sock_dir):
    clock = Clock()
    gens = Generations(FakeStore(), [0, 1], hb_timeout_s=3, clock=clock, wall=clock)
    coord = Coordinator(gens, max_workers=4)
    path = os.path.join(sock_dir, "ctl", "coord.sock")
    srv = ControlServer(path, coord.handlers())
    yield path, gens
    srv.close()


@pytest.mark.parametrize("members,error", [
    ([-1], "integers of at least 0"),
    ([True], "integers of at least 0"),
    ([0, 1.5], "integers of at least 0"),
    (["0"], "integers of at least 0"),
    ([10**9], "not a worker of this job"),
    ([2**70], "not a worker of this job"),
    ([0, 1, 1 + NEWCOMER_SPAN + 1], "not a worker of this job"),
    ([], "non-empty list"),
    ("0,1", "non-empty list"),
    (None, "non-empty list"),
    ([0, 1, 2, 3, 4], "above the job's maximum of 4"),
])
def test_resize_to_members_that_are_not_the_jobs_workers_is_refused(coordinator_socket, members, error):
    path, gens = coordinator_socket
    reply = talk(path, json.dumps({"op": "resize", "members": members}).encode() + b"\n")
    assert reply["ok"] is False and error in reply["error"], reply
    assert gens.desired == [0, 1] and gens.known == {0, 1}


def test_resize_to_known_workers_and_newcomers_just_above_them_is_accepted(coordinator_socket):
    path, gens = coordinator_socket
    reply = talk(path, b'{"op": "resize", "members": [0, 1, 2, 5]}\n')   # 3, 4: spawns never asked for
    assert reply == {"ok": True, "desired": [0, 1, 2, 5]}
    assert gens.known == {0, 1, 2, 5}
    assert talk(path, b'{"op": "resize", "members": [1]}\n') == {"ok": True, "desired": [1]}


def test_check_members_names_the_bad_id():
    with pytest.raises(ValueError, match="worker 1000000000 is not a worker of this job"):
        check_members([0, 10**9], {0, 1})
    assert check_members([3, 1, 1], {0, 1}) == [1, 3]
