"""gpuflex.elastic.protocol.store_values: the checks on values the coordinator reads from
processes it does not trust."""

from __future__ import annotations

import pytest

from gpuflex.elastic.protocol.store_values import MAX_WID, is_id_list, progress_record


@pytest.mark.parametrize("value", [[0], [3, 1, 2], [MAX_WID]])
def test_a_list_of_worker_ids_is_accepted(value):
    assert is_id_list(value)


@pytest.mark.parametrize("value", [
    [], None, 3, "1,2", (1, 2), [True], [1, False], [-1], [MAX_WID + 1], [1.0], ["1"], [[1]],
], ids=repr)
def test_anything_else_is_not_a_list_of_worker_ids(value):
    assert not is_id_list(value)


def test_a_progress_record_is_a_json_object_or_nothing():
    assert progress_record(b'{"wid": 0, "step": 7}') == {"wid": 0, "step": 7}
    for raw in (b"", b"not json", b"[1, 2]", b'"text"', b"7", b"\xff\xfe"):
        assert progress_record(raw) is None, raw
