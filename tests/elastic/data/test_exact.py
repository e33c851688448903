"""gpuflex.elastic.data.exact: the bitwise mode's integer sum of the units' gradients gives
the same bits for any grouping of the units over members and any order (the members are
threads here, meeting in a fake all-reduce; tests/e2e/test_elastic_jobs.py sums over real
processes), while the default mode's float sums do not; the mode's refusals, each one line."""

from __future__ import annotations

import threading

import pytest
import torch

from gpuflex.elastic.data import exact, exact_sum
from gpuflex.elastic.data.sampler import ElasticSampler
from gpuflex.elastic.data.split_plan import SplitPlan
from gpuflex.elastic.run.runtime import ElasticRun

UNIT, UNITS = 4, 8   # a global batch of 32 samples in 8 units


class Members:
    """N members' shared all-reduce: each deposits its tensor, the last one reduces (in
    member order), all read the result. Enough of Collectives for UnitGrads.reduce."""

    def __init__(self, n: int) -> None:
        self.n, self.slots, self.result = n, [None] * n, None
        self.barrier = threading.Barrier(n)

    def group(self, rank: int) -> "Member":
        return Member(self, rank)


class Member:
    backend, device, pg = "gloo", torch.device("cpu"), None

    def __init__(self, members: Members, rank: int) -> None:
        self.members, self.rank = members, rank

    def all_reduce_async(self, tensor) -> "Done":
        """A bucket of the integer sum: reduced at once here, its wait a formality."""
        self.call(None, tensor, torch.distributed.ReduceOp.SUM)
        return Done()

    def call(self, fn, tensor=None, op=None, group=None) -> bool:
        if tensor is None:   # a launched bucket's wait
            fn()
            return True
        m = self.members
        m.slots[self.rank] = tensor.clone()
        if m.barrier.wait() == 0:
            stacked = torch.stack(m.slots)
            m.result = stacked.amax(0) if op == torch.distributed.ReduceOp.MAX else stacked.sum(0)
        m.barrier.wait()
        tensor.copy_(m.result)
        m.barrier.wait()
        return True


class Done:
    def wait(self) -> bool:
        return True


def model_and_data() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    g = torch.Generator().manual_seed(1)
    return model, torch.randn(UNIT * UNITS, 16, generator=g), torch.randn(UNIT * UNITS, 4, generator=g)


def unit_grads(model, x, y, units: list[int]) -> exact.UnitGrads:
    """A member's units, each its own forward and backward (weighted as run.accumulate's)."""
    acc = exact.UnitGrads(list(model.parameters()))
    for u in units:
        sl = slice(u * UNIT, (u + 1) * UNIT)
        (torch.nn.functional.mse_loss(model(x[sl]), y[sl]) * (UNIT / len(x))).backward()
        acc.take()
    return acc


def bitwise_sum(grouping: list[list[int]]) -> list[torch.Tensor]:
    """The gradients every member ends with, the units grouped so over len(grouping)
    members (threads); asserts all members hold the same bits."""
    model, x, y = model_and_data()
    members, out = Members(len(grouping)), {}
    accs = [unit_grads(model, x, y, units) for units in grouping]
    votes = [torch.tensor([0, 1, 0], dtype=torch.int64) for _ in grouping]

    def member(rank: int) -> None:
        group = members.group(rank) if len(grouping) > 1 else None
        acc = accs[rank]
        acc.params = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
        vote = acc.reduce(group, UNITS, votes[rank])
        out[rank] = ([p.grad for p in acc.params], vote)

    threads = [threading.Thread(target=member, args=(r,)) for r in range(len(grouping))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first, vote = out[0]
    assert vote.tolist() == [0, len(grouping), 0]   # the boundary's vote rode the integer sum
    for rank in out:
        assert all(torch.equal(a, b) for a, b in zip(out[rank][0], first))
    return first


def float_sum(grouping: list[list[int]]) -> list[torch.Tensor]:
    """The default mode: each member's share in one backward, the members' gradients added
    in floats."""
    model, x, y = model_and_data()
    total = None
    for units in grouping:
        rows = torch.cat([torch.arange(u * UNIT, (u + 1) * UNIT) for u in units])
        model.zero_grad()
        (torch.nn.functional.mse_loss(model(x[rows]), y[rows]) * (len(rows) / len(x))).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        total = grads if total is None else [a + b for a, b in zip(total, grads)]
    return total


GROUPINGS = [[list(range(UNITS))],                       # alone
             [[0, 1, 2], [3, 4, 5], [6, 7]],            # 3 members, an even split
             [[0, 1, 2, 3, 4], [5, 6, 7]],              # 2 members, split by speed
             [[7], [3, 1, 2, 0, 6, 5, 4]]]              # the units in another order


CHUNKS = [None, 5]   # the module's chunk (these gradients are all "small"), and 5 elements: most
# gradients then take the large path, a chunk at a time, their last chunk a partial one, and
# the members' integer sums travel in buckets of about 12 elements (the module's: one bucket)


@pytest.mark.parametrize("chunk", CHUNKS)
def test_the_integer_sum_has_the_same_bits_for_any_grouping_of_the_units(chunk, monkeypatch):
    if chunk:
        monkeypatch.setattr(exact_sum, "CHUNK", chunk)
        monkeypatch.setattr(exact_sum, "BUCKET", 12)
    alone = bitwise_sum(GROUPINGS[0])
    for grouping in GROUPINGS[1:]:
        got = bitwise_sum(grouping)
        assert all(torch.equal(a, b) for a, b in zip(got, alone)), grouping
    # and it is the mean gradient, to float precision
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(alone, float_sum(GROUPINGS[0])))


def test_the_default_float_sum_differs_in_its_bits_across_groupings():
    alone = float_sum(GROUPINGS[0])
    differ = [g for g in GROUPINGS[1:] if not all(torch.equal(a, b) for a, b in zip(float_sum(g), alone))]
    assert differ, "the default mode's sums agreed bit for bit: the bitwise test would prove nothing"


def test_the_scale_leaves_room_for_every_unit_and_round_trips():
    for peak in (1e-30, 0.3, 1.0, 7.5e3, 1e30):
        k = exact.scale_exponent(peak, 100)
        q = exact.quantize(torch.tensor([peak, -peak]), k)
        assert int(q.abs().max()) * 100 < 2 ** 62   # 100 units at the peak cannot overflow int64
        assert int(q.abs().max()) * 2 * 128 >= 2 ** 62 // 4   # and the scale is not wastefully small
    assert exact.scale_exponent(0.0, 8) == 0
    x = torch.tensor([0.1, -2.5, 3e-3])
    k = exact.scale_exponent(2.5, 1)
    assert torch.equal(exact.dequantize(exact.quantize(x, k), k, torch.float32), x)


def test_a_non_finite_gradient_makes_every_gradient_nan_alike():
    p = torch.nn.Parameter(torch.zeros(3))
    acc = exact.UnitGrads([p])
    p.grad = torch.tensor([1.0, float("inf"), 0.0])
    acc.take()
    assert acc.reduce(None, 1, None) is None and torch.isnan(p.grad).all()
    p.grad = torch.tensor([1.0, 2.0, 0.0])     # a NaN in a later unit is not lost behind a finite one
    acc.take()
    p.grad = torch.tensor([1.0, float("nan"), 0.0])
    acc.take()
    assert acc.local_max() != acc.local_max() and acc.reduce(None, 2, None) is None and torch.isnan(p.grad).all()


def reference_sum(units: list[list[torch.Tensor]], global_units: int, dtypes) -> list[torch.Tensor]:
    """The sum as the module's docstring defines it, one unit at a time through float64:
    the bits the in-place path (UnitGrads.reduce) must reproduce."""
    flats = [torch.cat([g.reshape(-1).to(torch.float64) for g in grads]) for grads in units]
    k = exact.scale_exponent(max(float(f.abs().max()) for f in flats), global_units)
    total = sum(exact.quantize(f, k) for f in flats)
    out, off = [], 0
    for g, dtype in zip(units[0], dtypes):
        out.append(exact.dequantize(total[off:off + g.numel()], k, dtype).view(g.shape))
        off += g.numel()
    return out


@pytest.mark.parametrize("dtype,magnitude", [
    (torch.float32, 1.0), (torch.float32, 3e4),
    (torch.bfloat16, 0.5),
    (torch.float32, 1e-25),   # k beyond float32's exponents: the float64 path
    (torch.float16, 1.0),     # too few exponent bits for g x 2**k: the float64 path
])
@pytest.mark.parametrize("chunk", CHUNKS)
def test_the_in_place_quantization_has_the_bits_of_the_float64_definition(dtype, magnitude, chunk, monkeypatch):
    if chunk:
        monkeypatch.setattr(exact_sum, "CHUNK", chunk)
    g = torch.Generator().manual_seed(7)
    shapes = [(5, 3), (3,), (2, 2, 2)]
    params = [torch.nn.Parameter(torch.zeros(s, dtype=dtype)) for s in shapes]
    units = [[(torch.randn(s, generator=g) * magnitude * 10.0 ** torch.randint(-6, 1, s, generator=g)).to(dtype)
              for s in shapes] for _ in range(3)]
    units[1][0][0, 0] = 0.0
    want = reference_sum(units, 5, [dtype] * len(shapes))
    acc = exact.UnitGrads(params)
    for _ in range(2):      # twice: the kept buffers reused
        for grads in units:
            for p, u in zip(params, grads):
                p.grad = u.clone()
            acc.take()
        assert acc.reduce(None, 5, None) is None
        assert all(p.grad.dtype == dtype and torch.equal(p.grad, w) for p, w in zip(params, want))


def test_modes_and_units_are_read_from_the_arguments_then_the_environment():
    assert exact.exact_mode(None, {}) == "allclose"
    assert exact.exact_mode(None, {"GPUFLEX_EXACT": "bitwise"}) == "bitwise"
    assert exact.exact_mode("allclose", {"GPUFLEX_EXACT": "bitwise"}) == "allclose"
    with pytest.raises(ValueError, match="GPUFLEX_EXACT must be one of allclose, bitwise, got 'bits'"):
        exact.exact_mode(None, {"GPUFLEX_EXACT": "bits"})
    assert exact.unit_size(64, 2048, None, {}) == 8
    assert exact.unit_size(64, 2048, None, {"GPUFLEX_UNIT": "16"}) == 16
    assert exact.unit_size(64, 2048, 4, {"GPUFLEX_UNIT": "16"}) == 4
    for args, msg in (((60, 600, None), "not a multiple of 8; give unit="),
                      ((64, 2048, 5), "does not divide into units of 5")):
        with pytest.raises(ValueError, match=msg):
            exact.unit_size(*args, {})


def test_shares_are_whole_units():
    plan = SplitPlan(64, "speed", environ={}, unit=8)
    assert plan.shares_for(3) == (24, 24, 16)   # no plan yet: the even split in units
    plan.decide([[0.0, 1.0, 1.0, 0.0], [1.0, 3.0, 1.0, 0.0], [2.0, 1.0, 1.0, 0.0]], step=0, generation=1)
    assert all(n % 8 == 0 for n in plan.shares) and sum(plan.shares) == 64
    assert plan.shares[1] < plan.shares[0]   # the slow member got fewer units


def test_an_epochs_last_batch_is_cut_at_unit_boundaries_and_ends_in_a_short_unit():
    sampler = ElasticSampler(70, 32, epochs=1)   # batches of 32, 32 and 6 samples
    sampler.unit = 4
    shares = (12, 12, 8)
    full = [sampler.batch(0, r, 3, shares) for r in range(3)]
    assert [(b.offset, len(b.indices)) for b in full] == [(0, 12), (12, 12), (24, 8)]
    last = [sampler.batch(2, r, 3, shares) for r in range(3)]   # 6 samples: units of 4 and 2
    assert [(b.offset, len(b.indices)) for b in last] == [(0, 4), (4, 2), (6, 0)]
    assert sorted(torch.cat([b.indices for b in last]).tolist()) == sorted(sampler.global_batch(2)[2].tolist())


@pytest.fixture
def pinned(monkeypatch):
    """Bitwise mode pins torch's threads and deterministic kernels: put them back after."""
    threads, det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    monkeypatch.delenv("GPUFLEX_EXACT", raising=False)
    monkeypatch.delenv("GPUFLEX_UNIT", raising=False)
    yield
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(det)
    torch.utils.deterministic.fill_uninitialized_memory = fill


def make_run(model=None, **kw) -> ElasticRun:
    model = model or torch.nn.Linear(3, 1)
    return ElasticRun(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), num_samples=32,
                      global_batch_size=8, steps=2, **kw)


@pytest.mark.parametrize("kw,msg", [
    ({"exact": "bits"}, "exact must be one of allclose, bitwise, got 'bits'"),
    ({"exact": "bitwise", "unit": 3}, "global_batch_size 8 does not divide into units of 3"),
    ({"unit": 2}, "unit= is for exact='bitwise'"),
    ({"exact": "bitwise", "scaler": object()}, "loss scaler"),
    ({"exact": "bitwise", "shard": object()}, "with shard= is not supported"),
    ({"exact": "bitwise", "buffers": "average"}, "buffers='average' is not supported"),
])
def test_what_bitwise_mode_does_not_cover_is_refused_at_start_in_one_line(pinned, kw, msg):
    with pytest.raises(ValueError, match=msg) as e:
        make_run(**kw)
    assert "\n" not in str(e.value)


def test_a_standalone_bitwise_run_takes_its_units_one_by_one_and_refuses_a_whole_share(pinned):
    model = torch.nn.Linear(3, 1)
    run = make_run(model, exact="bitwise", unit=2)
    assert torch.get_num_threads() == 1 and torch.are_deterministic_algorithms_enabled()
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(32, 3, generator=g), torch.randn(32, 1, generator=g))
    seeds = []
    for x, y in run.loader(data):
        before = torch.random.get_rng_state()
        units = list(run.accumulate(x, y))
        assert [len(a) for a, _ in units] == [2, 2, 2, 2]
        assert torch.equal(torch.random.get_rng_state(), before)   # each unit drew from its own stream
        for xb, yb in run.accumulate(x, y):
            seeds.append(torch.rand(1).item())
            run.backward(torch.nn.functional.mse_loss(model(xb), yb))
        assert all(p.grad is not None for p in model.parameters())
        if run.step == 1:
            with pytest.raises(ValueError, match="run.backward got the loss of 8 samples, more than one unit"):
                run.backward(torch.nn.functional.mse_loss(model(x), y))
    assert len(set(seeds)) == len(seeds) == 8   # (step, unit): a stream of its own
