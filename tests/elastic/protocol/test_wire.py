"""The coordinator's control-socket wire (gpuflex.elastic.protocol.wire): a status reply is
parsed once into a CoordinatorStatus, and one of the wrong shape is refused naming the field."""

from __future__ import annotations

import pytest

from gpuflex.elastic.protocol.wire import (CoordinatorStatus, LeftOut, WireError, parse_status, resize_request,
                                           status_request)


def test_a_full_status_reply_is_parsed_into_its_fields():
    reply = {"ok": True, "generation": 3, "members": [0, 2], "desired": [0, 2, 5], "settled": False,
             "finished": False, "progress": {"wid": 0, "step": 7}, "forged": {"count": 0, "last": None},
             "min_workers": 1, "abort": None, "held": None, "unreachable": None,
             "forming": {"generation": 3, "since": 1.0}, "crashed": [], "waiting": [{"wid": 2, "for": [0]}],
             "generations_total": 3, "known": [0, 1, 2, 5], "rejected": [1],
             "left_out": [{"n": 1, "wid": 4, "reason": "late", "phase": "warm-up", "generation": 2, "at": 9.0}],
             "history": [{"generation": 3, "kind": "resize", "verified": True}]}
    got = parse_status(reply)
    assert (got.generation, got.members, got.desired, got.known, got.rejected) == (3, (0, 2), (0, 2, 5), (0, 1, 2, 5), (1,))
    assert got.left_out == (LeftOut(1, 4, "late", "warm-up", 9.0),)
    assert got.progress == {"wid": 0, "step": 7} and got.forming == {"generation": 3, "since": 1.0}
    assert got.waiting == ({"wid": 2, "for": [0]},) and got.history[0]["kind"] == "resize"
    assert not got.settled and not got.finished and got.min_workers == 1 and got.generations_total == 3


def test_keys_left_out_take_their_defaults_and_desired_stays_unsaid():
    """An older coordinator, a fake: what it does not say is not malformed. Without
    `desired` nothing is a stray (gpuflex.policy.reconcile), so it stays None, not []."""
    assert parse_status({"ok": True}) == CoordinatorStatus()
    assert parse_status({"ok": True}).desired is None
    assert parse_status({"desired": []}).desired == ()


@pytest.mark.parametrize("reply,field", [
    (["not", "an", "object"], "reply"),
    (None, "reply"),
    ({"generation": "3"}, "generation"),
    ({"generation": -1}, "generation"),
    ({"generation": True}, "generation"),
    ({"members": "0,1"}, "members"),
    ({"members": [0, "1"]}, "members"),
    ({"members": [0, True]}, "members"),
    ({"desired": [0, -2]}, "desired"),
    ({"desired": {"0": 1}}, "desired"),
    ({"known": "0"}, "known"),
    ({"rejected": 1}, "rejected"),
    ({"settled": "yes"}, "settled"),
    ({"finished": 1}, "finished"),
    ({"history": {"generation": 1}}, "history"),
    ({"crashed": ["worker 1 crashed"]}, "crashed"),
    ({"waiting": [None]}, "waiting"),
    ({"left_out": [{"n": 1}]}, "left_out[0].wid"),
    ({"left_out": [{"n": "1", "wid": 2}]}, "left_out[0].n"),
    ({"left_out": "2"}, "left_out"),
    ({"progress": [1, 2]}, "progress"),
    ({"held": "below MIN"}, "held"),
    ({"abort": "repeated"}, "abort"),
    ({"forged": 3}, "forged"),
    ({"min_workers": 1.5}, "min_workers"),
])
def test_a_reply_of_the_wrong_shape_is_refused_naming_the_field(reply, field):
    with pytest.raises(WireError) as e:
        parse_status(reply)
    assert e.value.field == field and field in str(e.value)
    assert isinstance(e.value, ValueError)   # what the control side already takes for no answer


def test_an_entry_that_is_no_worker_id_in_known_or_rejected_is_not_trusted():
    """Those lists only spare or drop the workers they name: a garbled entry names none."""
    got = parse_status({"known": [0, "1", 2], "rejected": [1, True, "2", -3]})
    assert (got.known, got.rejected) == ((0, 2), (1,))


def test_the_requests_are_built_here():
    assert status_request() == {"op": "status"}
    assert resize_request([0, 1, 3]) == {"op": "resize", "members": [0, 1, 3]}
    with pytest.raises(ValueError, match="list of worker ids"):
        resize_request([0, "1"])
