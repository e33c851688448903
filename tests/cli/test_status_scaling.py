"""`gpuflex status JOB` (issue 32): the job's measured throughput points, the model's
prediction for MIN..MAX and the margins, as text and under "scaling" in --json. The job
is recorded through the models (queued, too big for the test's slots: never started)."""

from __future__ import annotations

import json
import time

from gpuflex.config import load_config
from gpuflex.control import access
from gpuflex.control.service import JobService
from gpuflex.db.models import Event, Job
from tests.clirun import invoke


def recorded(config_path, points) -> int:
    svc = JobService(load_config(str(config_path)))
    try:
        with svc.sessions.begin() as s:
            job = Job(token=f"t-{time.time_ns()}"[-20:], name="scales", state="queued", argv=["true"],
                      workdir="/tmp", env={}, min_workers=8, max_workers=10, gpus_per_worker=1,
                      user=access.caller(), created_at=time.time(), world_size=0)
            for w, h, rate in points:
                job.events.append(Event(kind="throughput", message="measured", time=time.time(), count=1,
                                        data={"world": w, "hosts": h, "samples_per_s": rate, "readings": 2}))
            s.add(job)
            s.flush()
            return job.id
    finally:
        svc.close()


def test_status_json_gives_points_predictions_and_margins(home, config_path):
    job_id = recorded(config_path, [(8, 1, 800.0), (9, 1, 880.0)])
    r = invoke(home, config_path, "status", str(job_id), "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["id"] == job_id and "workers" in doc          # the fields there were, kept
    sc = doc["scaling"]
    assert [(p["world"], p["samples_per_s"]) for p in sc["points"]] == [(8, 800.0), (9, 880.0)]
    assert [p["world"] for p in sc["predicted"]] == [8, 9, 10]
    assert sc["predicted"][0]["samples_per_s"] == 800.0 and sc["why_not"] is None


def test_status_text_says_a_job_with_one_size_measured_has_too_few_measurements(home, config_path):
    job_id = recorded(config_path, [(8, 1, 800.0)])
    r = invoke(home, config_path, "status", str(job_id))
    assert r.exit_code == 0, r.output
    assert "scaling: measured 8w/1h 800/s" in r.stdout and "too few measurements" in r.stdout
    doc = json.loads(invoke(home, config_path, "status", str(job_id), "--json").stdout)
    assert doc["scaling"]["model"] is None and doc["scaling"]["predicted"] == []


def test_status_of_a_job_never_measured_shows_no_scaling_line(home, config_path):
    job_id = recorded(config_path, [])
    r = invoke(home, config_path, "status", str(job_id))
    assert r.exit_code == 0 and "scaling:" not in r.stdout
