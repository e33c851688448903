"""gpuflex.elastic.coordinator.progress_view: rank 0's progress record as status shows it,
its last checkpoint failure kept after the worker cleared it."""

from __future__ import annotations

import json

from gpuflex.elastic.coordinator.progress_view import ERROR_CHARS, ProgressView


def raw(**record) -> bytes:
    return json.dumps(record).encode()


def test_what_is_no_object_is_no_record():
    view = ProgressView(wall=lambda: 5.0)
    assert view.read(b"garbage") is None
    assert view.read(b"[1]") is None


def test_a_record_without_a_worker_or_count_is_shown_as_it_is():
    view = ProgressView(wall=lambda: 5.0)
    assert view.read(raw(step=3)) == {"step": 3}
    assert view.read(raw(wid=True, checkpoint_failures=1)) == {"wid": True, "checkpoint_failures": 1}


def test_a_failure_is_kept_after_the_next_write_clears_its_reason():
    view = ProgressView(wall=lambda: 99.0)
    clean = view.read(raw(wid=0, step=1, checkpoint_failures=0))
    assert clean["checkpoint_failures"] == {"count": 0, "last_error": None, "last_time": None}
    failed = view.read(raw(wid=0, step=2, checkpoint_failures=1, checkpoint_error="disk full", time=12.5))
    assert failed["checkpoint_failures"] == {"count": 1, "last_error": "disk full", "last_time": 12.5}
    cleared = view.read(raw(wid=0, step=3, checkpoint_failures=1, checkpoint_error=None))
    assert cleared["checkpoint_failures"] == {"count": 1, "last_error": "disk full", "last_time": 12.5}
    assert cleared["step"] == 3


def test_a_failure_without_a_time_is_dated_by_the_wall_clock():
    view = ProgressView(wall=lambda: 99.0)
    failed = view.read(raw(wid=1, checkpoint_failures=2, checkpoint_error="x" * 1000, time="soon"))
    assert failed["checkpoint_failures"]["last_time"] == 99.0
    assert len(failed["checkpoint_failures"]["last_error"]) <= ERROR_CHARS


def test_a_new_process_under_the_same_id_counts_from_zero():
    view = ProgressView(wall=lambda: 1.0)
    view.read(raw(wid=0, checkpoint_failures=3, checkpoint_error="old", time=1.0))
    again = view.read(raw(wid=0, checkpoint_failures=0))
    assert again["checkpoint_failures"] == {"count": 0, "last_error": None, "last_time": None}


def test_workers_are_kept_apart():
    view = ProgressView(wall=lambda: 1.0)
    view.read(raw(wid=0, checkpoint_failures=1, checkpoint_error="on 0", time=1.0))
    other = view.read(raw(wid=1, checkpoint_failures=0))
    assert other["checkpoint_failures"]["last_error"] is None
    assert view.failures[0]["last_error"] == "on 0"
