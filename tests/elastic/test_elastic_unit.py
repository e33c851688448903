"""The runtime's pure parts: the elastic sampler, state commits, checksums, checkpoints,
and the control socket's handling of bad clients."""

from __future__ import annotations

import json
import os
import socket
import stat

import pytest
import torch

from gpuflex.elastic.state.checkpoints import load_checkpoint, save_checkpoint
from gpuflex.elastic.protocol.control_socket import MAX_LINE, ControlServer
from gpuflex.elastic.data.sampler import ElasticSampler, split
from gpuflex.elastic.state.tree import Registry, checksum_tensors, flatten, unflatten
from gpuflex.hosts.relay import unix_exchange


@pytest.mark.parametrize("total,world", [(64, 1), (64, 3), (7, 4), (3, 5), (0, 2)])
def test_split_covers_the_batch_once_with_shares_within_one(total, world):
    parts = [split(total, world, r) for r in range(world)]
    covered = [i for off, n in parts for i in range(off, off + n)]
    assert covered == list(range(total))
    assert max(n for _, n in parts) - min(n for _, n in parts) <= 1


def test_every_sample_once_per_epoch_across_any_sequence_of_world_sizes():
    s = ElasticSampler(1000, 64, epochs=3, seed=7)
    worlds = [1, 3, 2, 4, 5, 1, 2]   # a resize every few steps
    seen: dict[int, list[int]] = {}
    for step in range(s.total_steps):
        world = worlds[(step // 5) % len(worlds)]
        ids = []
        for r in range(world):
            b = s.batch(step, r, world)
            assert b.global_size == len(s.global_batch(step)[2])
            ids += b.indices.tolist()
        assert ids == s.global_batch(step)[2].tolist()   # the split never changes the batch
        seen.setdefault(s.batch(step, 0, 1).epoch, []).extend(ids)
    assert sorted(seen) == [0, 1, 2]
    for epoch, ids in seen.items():
        assert sorted(ids) == list(range(1000)), epoch
    assert seen[0] != seen[1]   # a fresh shuffle per epoch


def test_weights_make_the_summed_gradient_the_full_batch_mean():
    torch.manual_seed(0)
    w = torch.randn(3, requires_grad=True)
    x = torch.randn(10, 3)
    (x @ w).pow(2).mean().backward()
    full = w.grad.clone()
    total = torch.zeros(3)
    for r in range(3):
        off, n = split(10, 3, r)
        w.grad = None
        ((x[off:off + n] @ w).pow(2).sum() / 10).backward()
        total += w.grad
    assert torch.allclose(total, full, rtol=1e-6)


def test_flatten_round_trip_keeps_structure_and_values():
    tree = {"a": torch.arange(3.0), "b": [1, (torch.ones(2, 2), "x")], "c": {"d": None}}
    skel, tensors = flatten(tree)
    assert len(tensors) == 2
    back = unflatten(skel, tensors)
    assert back["b"][0] == 1 and back["b"][1][1] == "x" and back["c"] == {"d": None}
    assert torch.equal(back["a"], tree["a"]) and torch.equal(back["b"][1][0], torch.ones(2, 2))


def test_light_state_is_captured_by_value_and_heavy_state_is_left_out():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    counters = {"tokens": 5}
    reg = Registry()
    for name, obj in (("model", model), ("optimizer", opt), ("scheduler", sched), ("extra.c", counters)):
        reg.add(name, obj)
    light = reg.capture_light()
    assert set(light) == {"scheduler", "extra.c", "optimizer.param_groups"}
    opt.step()
    sched.step()
    counters["tokens"] += 1
    assert opt.param_groups[0]["lr"] == 0.05
    reg.load(light, light_only=True)   # undo what a failed step did to the light state
    assert counters == {"tokens": 5} and sched.state_dict()["last_epoch"] == 0
    assert opt.param_groups[0]["lr"] == 0.1
    with pytest.raises(TypeError):
        reg.add("bad", object())


def test_undoing_a_step_restores_the_logs_also_across_an_epoch_edge(monkeypatch):
    from gpuflex.elastic.run.runtime import ElasticRun

    monkeypatch.setenv("GPUFLEX_STORE", "127.0.0.1:1")   # distributed: it commits (never started here)
    model = torch.nn.Linear(2, 1)
    run = ElasticRun(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                     num_samples=8, global_batch_size=2, epochs=3, track_samples=True)

    def confirm():
        run.state.confirm_step(run.sampler.global_batch(run.step)[2].tolist(), now=float(run.step),
                               world_size=run.world_size)

    for _ in range(3):   # steps 0-2 of epoch 0 (4 steps an epoch)
        confirm()
        run.state.commit()
    before = ({e: list(v) for e, v in run.samples.items()}, list(run.step_log), run.step)
    confirm()   # the last step of epoch 0 ...
    confirm()   # ... and the first of epoch 1, then a failure: both undone
    assert set(run.samples) == {0, 1} and len(run.samples[0]) == 8
    run.state.undo_step()
    assert ({e: list(v) for e, v in run.samples.items()}, run.step_log, run.step) == before
    for _ in range(5):   # past the edge, then undo a step inside epoch 1
        confirm()
        run.state.commit()
    kept = {e: list(v) for e, v in run.samples.items()}
    confirm()
    run.state.undo_step()
    assert run.samples == kept and run.step == 8 and sorted(run.samples[0]) == list(range(8))


def test_checksum_sees_a_one_bit_change():
    a = [torch.randn(100), torch.arange(5)]
    b = [a[0].clone(), a[1].clone()]
    assert checksum_tensors(a) == checksum_tensors(b)
    b[0].view(torch.int32)[17] ^= 1
    assert checksum_tensors(a) != checksum_tensors(b)


def test_checksum_sees_order_odd_tails_and_unaligned_views():
    a = [torch.randn(7).half(), torch.tensor([True, False, True]), torch.randn(101)[1:]]
    same = [t.clone() for t in a]
    assert checksum_tensors(a) == checksum_tensors(same)
    assert checksum_tensors(a) != checksum_tensors([a[1], a[0], a[2]])   # state in the wrong slot
    for i, flip in ((0, lambda t: t.view(torch.int16)[6].bitwise_xor_(4)),   # in the odd tail
                    (1, lambda t: t.__setitem__(1, True)),
                    (2, lambda t: t.view(torch.int32)[99].bitwise_xor_(1 << 30))):
        b = [t.clone() for t in a]
        flip(b[i])
        assert checksum_tensors(a) != checksum_tensors(b)


def test_checkpoint_write_is_atomic_and_loads_back(tmp_path):
    path = str(tmp_path / "ck" / "checkpoint.pt")
    save_checkpoint(path, {"state": {"w": torch.ones(3)}, "step": 5})
    assert load_checkpoint(path)["step"] == 5
    assert os.listdir(tmp_path / "ck") == ["checkpoint.pt"]   # no temp file left behind
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert load_checkpoint(str(tmp_path / "missing.pt")) is None


@pytest.fixture
def server(tmp_path):
    calls = []

    def status(msg):
        calls.append(msg)
        return {"step": 3}

    def boom(msg):
        raise RuntimeError("handler bug")

    path = f"/tmp/gpuflex-test-{os.getpid()}-{id(calls)}/c.sock"
    srv = ControlServer(path, {"status": status, "boom": boom})
    yield path, calls
    srv.close()
    os.rmdir(os.path.dirname(path))


def talk(path: str, payload: bytes, timeout: float = 5) -> dict:
    return json.loads(unix_exchange(path, payload, timeout))


def test_control_socket_is_0600_in_a_0700_directory(server):
    path, _ = server
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700


@pytest.mark.parametrize("payload,error", [
    (b"not json at all\n", "malformed JSON"),
    (b"[1, 2]\n", 'string "op"'),
    (b'{"op": "explode"}\n', "unknown op"),
    (b'{"op": "boom"}\n', "handler bug"),
    (b"\xff\xfe\n", "malformed JSON"),
])
def test_control_socket_answers_garbage_with_an_error_and_keeps_serving(server, payload, error):
    path, calls = server
    reply = talk(path, payload)
    assert reply["ok"] is False and error in reply["error"]
    assert talk(path, b'{"op": "status"}\n') == {"ok": True, "step": 3}
    assert calls == [{"op": "status"}]


def test_control_socket_refuses_an_oversized_message(server):
    path, _ = server
    reply = talk(path, b'{"op": "status", "pad": "' + b"x" * (MAX_LINE + 10))
    assert reply["ok"] is False and "too large" in reply["error"]
    assert talk(path, b'{"op": "status"}\n')["ok"] is True


def test_a_slow_client_gets_a_timeout_and_does_not_block_others(server):
    path, _ = server
    slow = socket.socket(socket.AF_UNIX)
    slow.connect(path)
    slow.sendall(b'{"op": "sta')          # never finishes its line
    try:
        assert talk(path, b'{"op": "status"}\n')["ok"] is True   # served meanwhile
        slow.settimeout(10)
        reply = json.loads(slow.recv(65536))
        assert reply["ok"] is False and "timeout" in reply["error"]
    finally:
        slow.close()


def test_rng_state_round_trips_numpy_with_and_without_a_cached_gaussian():
    np = pytest.importorskip("numpy")
    import random

    from gpuflex.elastic.state.tree import rng_state, set_rng_state

    def draws():
        return (np.random.standard_normal(), np.random.rand(), random.random(), float(torch.rand(1)))

    np.random.seed(0)
    for odd in (False, True, False):   # with and without numpy's cached Gaussian
        if odd:
            np.random.standard_normal()
        saved = rng_state()
        again = rng_state()   # unchanged: read again alike
        assert saved["numpy"][3] == again["numpy"][3]
        first = draws()
        set_rng_state(saved)
        assert draws() == first
        set_rng_state(again)
        assert draws() == first
    # a cached Gaussian consumed without the twister moving: still a different state
    np.random.seed(1)
    np.random.standard_normal()            # makes a pair: one cached
    before = rng_state()
    np.random.standard_normal()            # takes the cached one; the twister's words stay
    after = rng_state()
    assert before["numpy"][3] == 1 and after["numpy"][3] == 0
    expected = np.random.standard_normal()
    set_rng_state(after)
    assert np.random.standard_normal() == expected


def test_rng_state_round_trips_python_random_with_and_without_a_cached_gaussian():
    import random

    from gpuflex.elastic.state import tree as state

    random.seed(3)
    saved = state.rng_state()["python"]
    assert state.rng_state()["python"] == saved   # unchanged: read again alike
    assert saved == random.getstate()
    first = [random.random() for _ in range(3)]
    moved = state.rng_state()["python"]
    assert moved != saved and moved == random.getstate()
    state.set_rng_state({**state.rng_state(), "python": saved})
    assert [random.random() for _ in range(3)] == first
    # a cached Gaussian consumed without the twister moving: still a different state
    random.gauss(0.0, 1.0)                 # makes a pair, keeps one in gauss_next
    before = state.rng_state()["python"]
    random.gauss(0.0, 1.0)                 # takes it; the twister's words stay as they were
    after = state.rng_state()["python"]
    assert before[2] is not None and after[2] is None and after == random.getstate()
    expected = random.gauss(0.0, 1.0)
    state.set_rng_state({**state.rng_state(), "python": after})
    assert random.gauss(0.0, 1.0) == expected
