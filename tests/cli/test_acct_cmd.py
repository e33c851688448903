"""acct's cells: elapsed time as Slurm writes it, device time named by its kind."""

from __future__ import annotations

from gpuflex.cli import acct_cmd


def test_elapsed_reads_as_slurms_days_hours_minutes_seconds():
    assert [acct_cmd._span(s) for s in (None, 0, 59.6, 3661, 86400 + 7322)] == \
        ["-", "00:00:00", "00:01:00", "01:01:01", "1-02:02:02"]


def test_device_time_names_gpus_and_cpu_slots_apart():
    row = {"gpu_hours": 1.5, "slot_hours": 0.0}
    assert acct_cmd._device_time(row) == "1.50 GPU-h"
    assert acct_cmd._device_time({"gpu_hours": 0.0, "slot_hours": 2.0}) == "2.00 slot-h"
    assert acct_cmd._device_time({"gpu_hours": 1.0, "slot_hours": 2.0}) == "1.00 GPU-h, 2.00 slot-h"
    assert acct_cmd._device_time({"gpu_hours": 0.0, "slot_hours": 0.0}) == "-"
