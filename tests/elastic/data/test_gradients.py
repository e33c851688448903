"""gpuflex.elastic.data.gradients: which gradients are reduced in place and which packed,
the exchange's sum in rank order, and a failed reduce leaving no gradient. A fake group of
two ranks whose peer holds the same gradients: every sum is twice this rank's
(tests/elastic/run/test_runtime.py and tests/e2e/test_elastic_jobs.py reduce over real groups)."""

from __future__ import annotations

import torch

from gpuflex.elastic.data import gradients
from gpuflex.elastic.protocol import env


class Done:
    def wait(self) -> bool:
        return True


class Pg:
    """The peer's send and recv: it sends what this rank holds (the same gradients)."""

    def __init__(self) -> None:
        self.sent = 0

    def send(self, tensors, peer, tag):
        assert tag == gradients.EXCHANGE_TAG
        self.sent += 1
        self.last = tensors[0].clone()
        return Done()

    def recv(self, tensors, peer, tag):
        tensors[0].copy_(self.last)
        return Done()


class Group:
    """Two ranks; all-reduce doubles in place; `fail` makes every collective raise."""

    world_size, rank, failure = 2, 0, None

    def __init__(self, fail: bool = False) -> None:
        self.pg, self.fail, self.reduced, self.closers = Pg(), fail, [], []

    def on_close(self, fn):
        self.closers.append(fn)

    def call(self, fn):
        try:
            fn()
            return True
        except RuntimeError as e:
            self.failure = str(e)
            return False

    def all_reduce_async(self, tensor):
        if self.fail:
            raise RuntimeError("Connection closed by peer")
        self.reduced.append(tensor.numel())
        tensor.mul_(2)
        return Done()


class Agreement:
    size = 3

    def build(self, done_step):
        return torch.tensor([0, 0, 1])

    def summed(self, vec):
        self.vote = vec.tolist()


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 2))


def backward(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Run backward on `m`; returns this rank's own gradients, from a twin of the model
    without a plan (the fake group's in-place reduces change `m`'s during backward)."""
    m(torch.ones(4, 64)).sum().backward()
    twin = model()
    twin(torch.ones(4, 64)).sum().backward()
    return {n: p.grad for n, p in twin.named_parameters()}


def test_small_gradients_are_packed_with_the_agreement_and_summed(monkeypatch):
    monkeypatch.setenv(env.EXCHANGE_BYTES, "0")   # all-reduce, not the exchange
    m, group, agreement = model(), Group(), Agreement()
    plan = gradients.GradPlan(m, group, agreement, num_samples=100)
    assert plan.direct == [] and plan.fuse
    plan.arm()
    grads = backward(m)
    plan.reduce()
    for n, p in m.named_parameters():
        assert torch.equal(p.grad, 2 * grads[n]), n
    assert group.reduced == [plan.n + Agreement.size]   # one collective for all of it
    assert agreement.vote == [0, 0, 2]


def test_large_gradients_are_reduced_in_place_in_a_fixed_order(monkeypatch):
    monkeypatch.setenv(env.DIRECT_BYTES, str(64 * 64 * 4))   # the first weight is "large"
    monkeypatch.setenv(env.EXCHANGE_BYTES, "0")
    m, group = model(), Group()
    plan = gradients.GradPlan(m, group, Agreement(), num_samples=100)
    assert plan.direct == [0] and plan.packed == [1, 2, 3]
    plan.arm()
    grads = backward(m)
    assert group.reduced == [64 * 64]   # launched from its hook, during backward
    plan.reduce()
    assert torch.equal(m[0].weight.grad, 2 * grads["0.weight"])
    assert group.reduced == [64 * 64, plan.n + Agreement.size]


def test_a_small_buffer_on_gloo_is_exchanged_and_added_in_rank_order(monkeypatch):
    monkeypatch.delenv(env.EXCHANGE_BYTES, raising=False)
    m, group = model(), Group()
    plan = gradients.GradPlan(m, group, Agreement(), num_samples=100)
    assert plan.exchanges()
    plan.arm()
    grads = backward(m)
    plan.reduce()
    assert group.reduced == [] and group.pg.sent == 1
    assert torch.equal(m[1].bias.grad, 2 * grads["1.bias"])


def test_a_failed_reduce_leaves_every_gradient_unset():
    m, group = model(), Group(fail=True)
    plan = gradients.GradPlan(m, group, Agreement(), num_samples=100)
    plan.exchange_bytes = 0
    plan.arm()
    backward(m)
    plan.reduce()
    assert all(p.grad is None for p in m.parameters())
    assert group.failure == "Connection closed by peer"


def test_the_exchanged_copies_sum_the_same_on_every_rank():
    rows = torch.tensor([[1.0, 2.0], [10.0, 20.0], [100.0, 200.0]])
    for rank in range(3):
        buf = rows[rank].clone()
        copies = rows.clone()
        copies[rank] = 0   # this rank's row is filled from its own buffer
        gradients.sum_exchanged(buf, copies, rank)
        assert buf.tolist() == [111.0, 222.0]


def test_closing_the_group_forgets_the_works():
    m, group = model(), Group()
    plan = gradients.GradPlan(m, group, Agreement(), num_samples=100)
    plan.works = [Done()]
    group.closers[0]()
    assert plan.works == []
