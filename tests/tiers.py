"""The suite's two tiers: the fast one (`make test-fast`) and the rest, by marker.

A test that starts a process or a server carries a marker (registered in pyproject.toml):
`e2e` (gpuflex jobs, their workers and coordinators, the console script, any other child
process), `ssh` (the sshd bed), `postgres` (the PostgreSQL server), `slow` (frameworks, wheel
builds, the demo: anything that takes more than ~20 s). The fast tier is every test with
none of them.

Most tests get their marker here, from the fixtures they use, so a new test that takes
`gf` or `ssh_hosts` is marked without anyone remembering to. Modules whose tests start
processes themselves say so with `pytestmark`. And a test left in the fast tier that
starts a process anyway fails, in `make test` as in `make test-fast`: it must be marked.
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
from pathlib import Path

import pytest

from tests import TESTS

TIERS = ("e2e", "ssh", "postgres", "slow")

# Fixtures that start processes or servers, and the tier a test using them (directly or
# through another fixture) belongs to. A name alone is a fixture defined once (conftest,
# sshbed, or one test module); "FILE::name" one of a name several modules define. FILE, here
# and in TEST_TIERS and HEAVY_FILES, is the file's path under tests/.
FIXTURE_TIERS = {
    "gf": "e2e",            # the console script, and the jobs it starts
    "busy_slots": "e2e",    # a job of real `sleep` workers
    "podman_bed": "e2e",    # podman builds an image and runs a container (tests/podbed.py)
    "ssh_hosts": "ssh",
    "ssh_bed": "ssh",
    "pg_cluster": "postgres",
    "pg_url": "postgres",
    # pools of one module's jobs (the console script, real workers and coordinators)
    "ej": "e2e", "ej_pg2": "e2e", "fj": "e2e", "fm": "e2e", "pj": "e2e", "oj": "e2e", "lj": "e2e",
    "lp": "e2e", "gj": "e2e", "box": "e2e", "tilde_pool": "e2e", "local_pool": "e2e",
    "small_disk": "e2e", "tiny_disk": "e2e",   # a tmpfs mounted by mount(8)
    "elastic/run/test_runtime.py::job": "e2e",         # a real coordinator and its workers
    "e2e/test_fsdp_elastic.py::jobs": "e2e",
}

# A fixture parametrized over "clirunner" (in process) and "script" (the console script in
# a subprocess): only the "script" half starts a process.
PROCESS_PARAMS = {"script"}


# Tests of mixed modules (unit tests beside them) that start processes themselves, and the
# slowest process-free ones (more than ~8 s on a loaded 2-core machine; the fuzzing), by
# module and name (all of a parametrized test's cases). A new such test fails the guard
# until it is named here or its module's `pytestmark` covers it; test_tiers checks that
# every name is a test.
# Tests that run `sys.executable -c` to see what a fresh interpreter imports are here too:
# importing gpuflex anew costs 1 to 3 s here, as much as ten unit tests.
TEST_TIERS = {
    "elastic/sharding/test_checkpoints.py": {
        "test_a_worker_imports_no_distributed_checkpoint_until_a_sharded_job_needs_it": "e2e"},
    "control/test_access.py": {"test_another_users_queued_job_keeps_its_place_until_its_owner_starts_it": "e2e"},
    "cli/test_bad_input.py": {
        "test_bad_config_through_the_environment_is_the_same_error": "e2e",
        "test_unknown_job_on_an_empty_db_leaves_it_empty": "e2e"},
    "elastic/state/test_checkpoints.py": {
        "test_a_script_resumes_from_the_previous_checkpoint_and_ends_exact_or_fails_with_one_line": "e2e"},
    "cli/test_cli.py": {
        "test_a_host_python_that_cannot_run_is_reported_not_a_traceback": "e2e",
        "test_logs_prints_all_of_a_large_log_with_one_prefix_per_line": "slow",
        "test_gpuflex_toml_in_the_working_directory_is_found": "e2e",
        "test_python_dash_m_gpuflex_is_the_same_cli": "e2e"},
    "test_config.py": {"test_builtin_default_through_the_cli_makes_the_db_under_local_state": "e2e"},
    "db/test_engine.py": {
        "test_concurrent_cli_commands_on_a_fresh_db_all_succeed": "e2e",
        "test_concurrent_first_use_migrates_once": "e2e",
        "test_db_upgrade_command_reports_the_revision": "e2e"},
    "e2e/ssh/test_doctor.py": {
        "test_bad_input_is_one_error_line_and_exit_2": "e2e",
        "test_the_built_in_local_pool_passes_with_its_gpu_checks_skipped": "e2e"},
    "control/test_journal.py": {
        "test_five_thousand_identical_events_are_one_row_with_their_count_and_last_time": "slow",
        "test_status_reads_a_few_rows_whatever_the_job_s_history_holds": "slow"},
    "e2e/test_event_times.py": {
        "test_a_jobs_formation_and_exits_are_dated_by_its_coordinator_and_workers_not_the_command": "e2e"},
    "elastic/protocol/test_failpoints.py": {
        "test_a_process_started_with_a_bad_spec_exits_2_with_one_error_line": "e2e",
        "test_armed_from_the_environment_at_import": "e2e",
        "test_exit_ends_the_process_with_that_status": "e2e",
        "test_kill_sigkills_the_process_after_its_line": "e2e",
        "test_stop_stops_the_process_until_it_is_continued": "e2e",
        "test_unarmed_no_point_does_anything": "e2e"},
    "e2e/test_file_security.py": {
        "test_a_cancelled_jobs_socket_directory_is_removed": "e2e",
        "test_a_spawned_processs_job_files_are_owner_only_and_the_users_own_files_keep_the_umask": "e2e",
        "test_another_user_can_neither_read_a_jobs_files_nor_break_its_start": "e2e",
        "test_another_user_cannot_read_the_database": "e2e",
        "test_hostops_never_uses_another_users_socket_directory_or_a_symlink": "e2e"},
    "e2e/test_fsdp_elastic.py": {
        "test_a_corrupted_move_is_refused_everywhere_and_the_old_holders_roll_back_exactly": "e2e",
        "test_a_newcomer_reserves_its_share_before_it_meets_the_others_and_a_holder_does_not": "e2e",
        "test_standalone_sharded_equals_the_unsharded_script": "e2e"},
    "cli/test_fuzz_input.py": {"test_generated_command_lines": "slow", "test_generated_broken_configs": "slow"},
    "benchmarks/test_gpu_check.py": {
        "test_the_gpu_check_dry_run_captures_the_probe_and_matches_a_standalone_run": "e2e",
        "test_the_gpu_check_refuses_an_unknown_part": "e2e"},
    "cli/test_help.py": {"test_help_needs_no_config_or_database": "e2e"},
    "control/test_metrics.py": {
        "test_the_cron_example_writes_a_whole_file_by_rename": "e2e",
        "test_without_prometheus_client_the_command_says_what_to_install": "e2e"},
    "control/test_notify.py": {"test_jobs_that_end_post_once_and_an_unreachable_url_fails_nothing": "e2e"},
    "hosts/test_probe.py": {
        "test_fake_nvidia_smi_speaks_the_real_csv": "e2e",
        "test_probe_host_errors_name_the_host_and_the_cause": "e2e",
        "test_probe_host_learns_the_user_of_a_foreign_process": "e2e",
        "test_the_fake_heads_its_columns_as_the_real_h200_did": "e2e"},
    "control/test_quota_jobs.py": {
        "test_a_job_over_quota_waits_then_starts_when_the_other_ends_and_a_scale_over_it_is_refused": "e2e",
        "test_report_by_user_counts_slot_hours_on_a_pool_of_cpu_slots": "e2e",
        "test_the_fair_share_and_report_queries_agree_on_both_backends": "e2e"},
    "elastic/sharding/test_reshard.py": {
        "test_real_processes_end_with_a_fresh_cut_at_the_new_size": "e2e",
        "test_a_sharded_parameter_gathered_through_cpu_is_whole_in_rank_order": "e2e"},
    "control/test_restarts.py": {
        "test_a_restart_job_scaled_2_3_1_ends_equal_to_a_fixed_size_run_and_a_gang_is_not_scaled": "e2e"},
    "elastic/run/test_runtime.py": {
        "test_the_loaders_workers_yield_exactly_the_wanted_batch_across_a_resize_and_an_undo": "e2e"},
    "elastic/test_runtime_parts.py": {
        "test_a_member_whose_group_failed_to_form_forms_the_next_one_with_the_others": "e2e"},
    "cli/test_scale_cmd_wait.py": {"test_a_shrinks_wait_ends_once_its_leaver_has_exited": "slow"},
    "elastic/data/test_shares.py": {"test_the_loader_never_serves_a_batch_read_for_an_old_plan": "e2e"},
    "e2e/ssh/test_ssh_transport.py": {"test_a_local_command_timeout_is_the_same_error": "e2e"},
    "cli/test_status_cmd.py": {"test_status_through_a_pipe_keeps_every_column_whole": "e2e"},
    "test_structure.py": {"test_the_store_protocol_and_worker_environment_are_imported_without_torch": "e2e"},
    "hosts/test_transport.py": {
        "test_the_host_side_modules_need_only_the_standard_library": "e2e",
        "test_the_ssh_module_is_loaded_only_for_the_first_ssh_host": "e2e"},
    "control/test_launch_env.py": {
        "test_a_job_more_than_the_probed_gpus_can_hold_is_refused_and_nothing_changes": "e2e"},
}


def _fixture_keys(item: pytest.Item) -> set[str]:
    """The names of the fixtures the test uses, and each as FILE::name where it was defined."""
    info = getattr(item, "_fixtureinfo", None)
    keys = set(getattr(item, "fixturenames", ()))
    for name, defs in (info.name2fixturedefs.items() if info is not None else ()):
        for d in defs:
            # baseid: the defining module's node id, from the repository root
            keys.add(f"{d.baseid.removeprefix('tests/')}::{name}")
    return keys


# Seconds each of the heaviest files took in a serial full run (docs/testing.md; the last three,
# new, alone on a loaded machine). `make test` runs the files on several pytest workers (pytest-xdist, `--dist
# loadfile`: a file's tests, and its module fixtures, stay on one worker) in the order
# collected; these go first, so the run does not end waiting on one long file that started last.
HEAVY_FILES = {
    "e2e/test_fsdp_elastic.py": 433, "e2e/test_fault_matrix_phases.py": 381, "e2e/test_elastic_jobs.py": 324,
    "e2e/test_frameworks.py": 207, "e2e/test_real_training.py": 205, "e2e/ssh/test_ssh_jobs.py": 190,
    "e2e/test_liveness_jobs.py": 152, "e2e/test_demo.py": 133, "e2e/test_fault_matrix.py": 115,
    "cli/test_bad_input.py": 90, "e2e/ssh/test_fsdp_ssh.py": 80, "e2e/test_gang_jobs.py": 76,
    "e2e/test_hetero_split.py": 75, "e2e/test_postgres.py": 75, "e2e/test_orphans.py": 65,
    "e2e/test_formation_deadline.py": 61, "cli/test_cli.py": 59, "control/test_crashes.py": 59,
    "e2e/test_bitwise_jobs.py": 266, "e2e/ssh/test_partition_ssh.py": 255,
    "e2e/test_allocation_converges.py": 80,
    "e2e/ssh/test_soak_hosts.py": 600,   # the multi-host soak's 5-minute form, its drain and checks
}


def file_key(path: Path) -> str:
    """A test file as TEST_TIERS, FIXTURE_TIERS and HEAVY_FILES key it: its path under
    tests/ (a file outside tests/, as tests/test_tiers.py's own examples are, by its name)."""
    return path.relative_to(TESTS).as_posix() if path.is_relative_to(TESTS) else path.name


def heaviest_first(items: list[pytest.Item]) -> None:
    """`items` reordered in place: HEAVY_FILES' files first, heaviest first, then the rest as
    collected (a stable sort: each file's own order is kept)."""
    items.sort(key=lambda item: -HEAVY_FILES.get(file_key(item.path), 0))


def mark_tiers(items: list[pytest.Item]) -> None:
    """Add to each test the tier markers its fixtures (and its "script" parameters) imply,
    and those TEST_TIERS names."""
    for item in items:
        named = TEST_TIERS.get(file_key(item.path), {}).get(getattr(item, "originalname", item.name))
        if named is not None:
            item.add_marker(named)
        for key in _fixture_keys(item):
            tier = FIXTURE_TIERS.get(key)
            if tier is not None:
                item.add_marker(tier)
        callspec = getattr(item, "callspec", None)
        if callspec is not None and PROCESS_PARAMS & {v for v in callspec.params.values() if isinstance(v, str)}:
            item.add_marker("e2e")


def tiers_of(item: pytest.Item) -> set[str]:
    return {m.name for m in item.iter_markers() if m.name in TIERS}


class StartedAProcess(BaseException):
    """Raised where a fast-tier test starts a process. A BaseException, so that the code
    under test's `except Exception` (or `except OSError`, as around a Popen) cannot swallow it."""


@pytest.fixture(autouse=True)
def fast_tier_starts_no_process(request, monkeypatch):
    """In a test with no tier marker, starting a process (subprocess, fork, posix_spawn,
    os.system, multiprocessing) raises StartedAProcess, and the test fails at teardown too
    (in case the start happened on a thread whose exception the test never sees). Yields
    the starts it refused (None in a marked test)."""
    if tiers_of(request.node):
        yield None
        return
    started: list[str] = []

    def refuse(what: str):
        def refused(*args, **kwargs):
            started.append(f"{what}{args[1:2] if what == 'subprocess' else ''}")
            raise StartedAProcess(
                f"{request.node.nodeid} started a process ({what}) but has no tier marker: "
                f"mark it with one of {', '.join(TIERS)} (tests/tiers.py), or use a marked fixture")
        return refused

    # _execute_child is where every Popen (run, check_output, asyncio's subprocesses) forks,
    # whichever way the caller imported Popen.
    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse("subprocess"))
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse("multiprocessing"))
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, refuse(f"os.{name}"))
    yield started
    if started:
        pytest.fail(f"{request.node.nodeid} started a process with no tier marker ({started[0]}): "
                    f"mark it with one of {', '.join(TIERS)} (tests/tiers.py)", pytrace=False)
