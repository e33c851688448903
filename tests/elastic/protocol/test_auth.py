"""The job store's authentication, without processes: signed records (gpuflex.elastic.protocol.auth),
the coordinator's logic ignoring forged ones and putting its own back, a worker ignoring a
forged generation, the state header as signed JSON (no pickle), and the store listening
only where it is told."""

from __future__ import annotations

import datetime as dt
import json
import pathlib
import socket
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed import TCPStore

from gpuflex.elastic.protocol import keys
from gpuflex.elastic.protocol.auth import Forged, Signer, sign, verify
from gpuflex.elastic.membership.collectives import Collectives
from gpuflex.elastic.coordinator.main import serve_store
from gpuflex.elastic.state.copy_header import header_text, read_header
from gpuflex.elastic.coordinator.generations import Generations
from gpuflex.elastic.membership.rendezvous import Rendezvous, StoreLost
from gpuflex.elastic.state.tree import TensorRef, flatten
from tests import REPO
from tests.fakes.store_fake import Clock, FakeStore

SECRET = "5e" * 32
OTHER = "0f" * 32


# ---- auth: sign and verify -------------------------------------------------------------------
def test_a_signed_record_verifies_under_its_key_and_secret():
    text = sign(SECRET, "members/3", '{"members": [0, 1]}')
    assert verify(SECRET, "members/3", text) == '{"members": [0, 1]}'
    assert verify(SECRET, "members/3", text.encode()) == '{"members": [0, 1]}'


@pytest.mark.parametrize("case", ["wrong secret", "other key", "tampered value", "unsigned",
                                  "truncated", "bad mac", "binary"])
def test_a_record_that_is_not_exactly_what_the_secret_signed_is_forged(case):
    good = sign(SECRET, "verdict/3", '{"ok": true}')
    key, text = "verdict/3", good
    if case == "wrong secret":
        text = sign(OTHER, key, '{"ok": true}')
    elif case == "other key":        # a valid record replayed under another generation's key
        key = "verdict/4"
    elif case == "tampered value":
        text = good.replace("true", "false")
    elif case == "unsigned":
        text = '{"ok": true}'
    elif case == "truncated":
        text = good[:40]
    elif case == "bad mac":
        text = good[:4] + ("0" if good[4] != "0" else "1") + good[5:]
    elif case == "binary":
        text = b"\xff\xfe" + good.encode()
    with pytest.raises(Forged) as e:
        verify(SECRET, key, text)
    assert e.value.key == key


def test_the_key_and_value_boundary_cannot_be_shifted():
    text = sign(SECRET, "a", "b.c")
    with pytest.raises(Forged):
        verify(SECRET, "a.b", text.replace(".b.c", ".c"))


def test_a_signer_binds_records_to_its_run_and_passes_values_through_without_a_secret():
    run1, run2 = Signer(SECRET, "run1"), Signer(SECRET, "run2")
    text = run1.sign("finished", "1")
    assert run1.verify("finished", text) == "1"
    with pytest.raises(Forged):        # a record of an earlier store of the job
        run2.verify("finished", text)
    plain = Signer(None, "run1")
    assert not plain.enabled and plain.sign("finished", "1") == "1" and plain.verify("finished", b"1") == "1"
    with pytest.raises(Forged):        # a worker with a secret takes no unsigned record
        run1.verify("finished", "1")


# ---- the coordinator's logic ignores what does not verify ----------------------------------------
HB = 3.0


class Job:
    """The coordinator's logic with the job's secret; `write` is a member's signed write,
    `forge` an attacker's (no secret, or a wrong one)."""

    def __init__(self, initial: list[int]) -> None:
        self.store, self.clock = FakeStore(), Clock()
        self.gens = Generations(self.store, initial, hb_timeout_s=HB, clock=self.clock, wall=self.clock,
                                secret=SECRET)
        self.signer = self.gens.signer

    def write(self, key: str, value: str = "1") -> None:
        self.store.set(key, self.signer.sign(key, value))
        self.store.add(keys.EVENTS, 1)

    def forge(self, key: str, value: str = "1", secret: str | None = None) -> None:
        self.store.set(key, Signer(secret, self.signer.run).sign(key, value) if secret else value)
        self.store.add(keys.EVENTS, 1)

    def ready(self, *wids: int) -> None:
        for w in wids:
            self.store.add(keys.hb(w), 1)
            self.write(keys.ready(w), "0")

    def record(self, g: int) -> dict:
        return json.loads(self.signer.verify(keys.members(g), self.store.data[keys.members(g)]))

    def latest(self) -> int:
        return int(self.store.data.get(keys.LATEST, b"0"))

    def settled(self, members: list[int]) -> "Job":
        self.ready(*members)
        self.gens.tick()
        self.write(keys.verdict(1), '{"ok": true}')
        self.write(keys.timings(1), '{"generation": 1}')
        self.gens.tick()
        assert self.gens.status()["settled"]
        return self


def test_a_forged_resize_request_is_ignored_and_reported():
    job = Job([0, 1, 2]).settled([0, 1, 2])
    job.forge(keys.DESIRED_REQUEST, json.dumps({"members": [0], "seq": 99}))
    job.gens.tick()
    job.forge(keys.DESIRED_REQUEST, json.dumps({"members": [0], "seq": 100}), secret=OTHER)
    job.gens.tick()
    assert job.gens.desired == [0, 1, 2] and job.latest() == 1
    assert job.gens.status()["forged"] == {"count": 2, "last": keys.DESIRED_REQUEST}


def test_a_signed_resize_request_is_acted_on_once_and_a_replay_of_an_older_one_is_not():
    job = Job([0, 1, 2]).settled([0, 1, 2])
    old = job.signer.sign(keys.DESIRED_REQUEST, json.dumps({"members": [0], "seq": 1}))
    job.write(keys.DESIRED_REQUEST, json.dumps({"members": [0, 1], "seq": 2}))
    job.gens.tick()
    assert job.gens.desired == [0, 1] and job.record(2)["members"] == [0, 1]
    job.store.set(keys.DESIRED_REQUEST, old)    # recorded earlier, replayed by someone
    job.store.add(keys.EVENTS, 1)
    job.gens.tick()
    assert job.gens.desired == [0, 1] and job.gens.status()["forged"]["count"] == 1


def test_unsigned_worker_records_do_not_form_or_break_generations():
    job = Job([0, 1])
    for w in (0, 1):
        job.store.add(keys.hb(w), 1)
        job.forge(keys.ready(w), "0")
    job.gens.tick()
    assert job.latest() == 0                     # forged readiness: nobody is ready
    job.settled([0, 1])
    job.forge(keys.verdict(1), '{"ok": false, "reason": "forged"}')
    for key in (keys.done(1), keys.fail(1, 0), keys.FINISHED, keys.timings(2)):
        job.forge(key)
    job.forge(keys.PROGRESS, "not json")         # unsigned, shown only: a bad one is dropped
    job.clock.advance(1)
    job.store.add(keys.hb(0), 1)
    job.store.add(keys.hb(1), 1)
    job.gens.tick()
    st = job.gens.status()
    assert job.latest() == 1 and not st["finished"] and st["settled"] and st["progress"] is None
    assert st["forged"]["count"] == 5


def test_the_coordinator_puts_back_its_records_and_deletes_a_generation_it_did_not_publish():
    job = Job([0, 1]).settled([0, 1])
    mine = job.store.data[keys.members(1)]
    fake = json.dumps({"generation": 2, "kind": "resize", "members": [0, 1, 99], "prev": [0, 1],
                       "created": 0, "message": "x"})
    job.forge(keys.members(2), fake)
    job.forge(keys.LATEST, "2")
    job.forge(keys.members(1), fake.replace('"generation": 2', '"generation": 1'))
    job.forge(keys.RUN, "attacker")
    job.gens.tick()
    assert keys.members(2) not in job.store.data and job.latest() == 1
    assert job.store.data[keys.members(1)] == mine
    assert Signer(SECRET).verify(keys.RUN, job.store.data[keys.RUN]) == job.signer.run
    assert job.gens.status()["forged"]["count"] == 4


# ---- a worker ignores a forged generation record ---------------------------------------------------
@pytest.fixture
def real_store():
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=dt.timedelta(seconds=10))
    yield store


def test_a_worker_ignores_a_forged_generation_and_joins_the_signed_one(real_store):
    gens = Generations(real_store, [0], hb_timeout_s=HB, secret=SECRET)
    rdzv = Rendezvous(f"127.0.0.1:{real_store.port}", 0, secret=SECRET, timeout_s=10, heartbeat_s=0.05)
    try:
        fake = {"generation": 1, "kind": "initial", "members": [0, 7], "prev": [], "created": 0}
        real_store.set(keys.members(1), json.dumps(fake))
        real_store.set(keys.LATEST, "1")
        polls = iter(range(20))
        assert rdzv.wait_for_generation(0, False, lambda: next(polls, None) is None) is None
        assert rdzv.generation(1) is None and rdzv.newest_after(0) == 0
        assert rdzv.forged.count == 1 and rdzv.forged.last == keys.members(1)
        rdzv.set(keys.ready(0), "0")
        gens.tick()                              # deletes the forged record, publishes its own
        info = rdzv.wait_for_generation(0, False, lambda: False)
        assert info["members"] == [0] and gens.status()["forged"]["count"] == 1
    finally:
        rdzv.close()


@pytest.mark.parametrize("coordinator_secret", [SECRET, None])
def test_a_worker_with_a_secret_refuses_a_store_signed_otherwise_or_not_at_all(real_store, coordinator_secret):
    Generations(real_store, [0], hb_timeout_s=HB, secret=coordinator_secret)
    with pytest.raises(StoreLost, match="not signed with this job's secret"):
        Rendezvous(f"127.0.0.1:{real_store.port}", 1, secret=OTHER, timeout_s=0.3, heartbeat_s=0.05)


def test_without_a_secret_on_either_side_a_job_runs_unauthenticated(real_store):
    gens = Generations(real_store, [0], hb_timeout_s=HB, secret=None)
    rdzv = Rendezvous(f"127.0.0.1:{real_store.port}", 0, secret=None, timeout_s=10, heartbeat_s=0.05)
    try:
        rdzv.set(keys.ready(0), "0")
        assert real_store.get(keys.ready(0)) == b"0"   # written as it is
        deadline = time.monotonic() + 30

        def coordinator_ticks() -> bool:   # as the coordinator's loop does, bounded: never a hang
            gens.tick()
            return time.monotonic() > deadline

        formed = rdzv.wait_for_generation(0, False, coordinator_ticks)
        assert formed is not None and formed["members"] == [0]
    finally:
        rdzv.close()


# ---- the state header: signed JSON over a uint8 tensor -------------------------------------------
def state_tree() -> dict:
    return {"objects": {"model": {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(2)},
                        "optimizer": {"param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0, 1]}],
                                      "state": {0: {"step": torch.tensor(3.0)}}}},
            "rng": (1, [2, 3], None)}


def test_the_state_header_round_trips_as_json_and_refuses_another_generation_or_sender():
    skeleton, tensors = flatten(state_tree())
    logs = {"step_log": [[0, 1.5, 2]], "samples": {"0": [1, 2]}}
    signer = Signer(SECRET, "run")
    text = signer.sign(keys.state(4), header_text(1, skeleton, tensors, logs))
    h = read_header(signer.verify(keys.state(4), text), 1)
    assert h["skeleton"] == skeleton and h["logs"] == logs
    assert h["layout"] == tuple((t.dtype, t.device, tuple(t.shape)) for t in tensors)
    assert isinstance(h["skeleton"]["objects"]["model"]["w"], TensorRef)
    with pytest.raises(Forged):
        signer.verify(keys.state(5), text)       # a header of generation 4 replayed in 5
    with pytest.raises(ValueError):
        read_header(signer.verify(keys.state(4), text), 0)
    with pytest.raises(Forged):                  # a pickle, or anything unsigned, is refused
        signer.verify(keys.state(4), "\x80\x04\x95")


def test_bytes_broadcast_as_a_length_and_a_uint8_tensor():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = Collectives(torch.device("cpu"), timeout_s=5)
        assert group.broadcast_bytes(b'{"x": 1}', 0, 100) == b'{"x": 1}'
        assert group.broadcast_bytes(b"", 0, 100) == b""
        with pytest.raises(ValueError, match="limit"):
            group.broadcast_bytes(b"x" * 101, 0, 100)
    finally:
        dist.destroy_process_group()


def test_the_runtime_has_no_pickle_on_the_wire():
    """No object collective anywhere in the runtime, and pickle imported in one place only:
    sharding/checkpoints.py, whose allow-list unpickler reads DCP's on-disk .metadata from
    private files (each member saves and loads alone, so DCP sends no pickle either)."""
    src = REPO / "gpuflex" / "elastic"
    paths = sorted(src.rglob("*.py"))
    assert len(paths) > 40   # every module of the runtime, in its sub-packages
    for path in paths:
        text = path.read_text()
        for word in ("broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
                     "pickle.loads", "pickle.load(", "send_object_list", "recv_object_list"):
            assert word not in text, f"{path.name} uses {word}"
        if path != src / "sharding" / "checkpoints.py":
            assert "import pickle" not in text, f"{path.name} imports pickle"
        if "dcp.save(" in text or "dcp.load(" in text:
            assert text.count("no_dist=True") >= text.count("dcp.save(") + text.count("dcp.load("), path.name
    reader = (src / "sharding" / "checkpoints.py").read_text()
    assert "def find_class" in reader and "raise UnsafeCheckpoint" in reader


# ---- the store listens where it is told --------------------------------------------------------
def listening(port: int) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp* writes them) that listen on `port`."""
    out = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = pathlib.Path(name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            addr, hexport = local.split(":")
            if state == "0A" and int(hexport, 16) == port:
                out.add(addr)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_store_listens_only_on_the_bind_address():
    port = free_port()
    store = serve_store("127.0.0.1", port)
    assert listening(port) == {"0100007F"}   # 127.0.0.1, and nothing else
    client = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                      timeout=dt.timedelta(seconds=5))
    client.set("k", "v")
    assert store.get("k") == b"v"
    del client, store
    assert listening(port) == set()            # the store closed the socket it was given


def test_the_default_bind_listens_on_every_interface():
    port = free_port()
    store = serve_store("0.0.0.0", port)
    assert listening(port) == {"00000000"}
    del store
