"""`submit --image` in-process (issue 33): refused with nothing recorded when this
machine's engine lacks the image or the name is none, recorded and shown when it has it
(from the command line or a #GPUFLEX directive), and what the launch gives each host's
supervisor. The engine's answer is stubbed here (`podman image exists` is a process);
tests/e2e/test_container_jobs.py runs real containers."""

from __future__ import annotations

import json

import pytest

from gpuflex.config import load_config
from gpuflex.control import launch
from gpuflex.db.models import Job
from gpuflex.errors import TransportError
from gpuflex.hosts import container
from gpuflex.hosts.transport import CommandResult
from tests.cli.test_submit_sync import blocked, run
from tests.conftest import db_dump, db_rows, write_config

HAVE = "localhost/train:1"


@pytest.fixture
def engine(monkeypatch):
    """This machine's engine holds HAVE only; the images it was asked about."""
    asked = []

    def missing(engine: str, image: str, timeout_s: float = 60.0):
        asked.append((engine, image))
        return None if image == HAVE else container.missing_text(engine, image)

    monkeypatch.setattr(container, "image_missing", missing)
    return asked


def test_an_image_the_engine_lacks_is_refused_with_nothing_recorded(home, engine):
    cfg = write_config(home, extra='container = "docker"\n')
    blocked(cfg)
    before = db_dump(home / "g.db")
    r = run(cfg, home, "submit", "--image", "localhost/nope:2", "--", "python", "train.py")
    assert r.exit_code == 2 and "Traceback" not in r.stderr
    assert "--image: docker has no image 'localhost/nope:2' (pull or build it there first) (host local)." in r.stderr
    assert engine == [("docker", "localhost/nope:2")]
    for bad in ("", "a b"):
        assert run(cfg, home, "submit", "--image", bad, "--", "true").exit_code == 2
    assert db_dump(home / "g.db") == before


def test_the_image_is_recorded_and_shown_from_the_command_line_or_a_directive(home, engine):
    cfg = write_config(home)
    blocked(cfg)
    r = run(cfg, home, "submit", "--after", "1", "--image", HAVE, "--json", "--", "python", "train.py")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["image"] == HAVE and engine == [("podman", HAVE)]
    assert f"image: {HAVE} (each worker in a container)" in run(cfg, home, "status", "2").stdout
    script = home / "train.sh"
    script.write_text(f"#!/bin/sh\n#GPUFLEX --image {HAVE} --after 1\npython train.py\n")
    script.chmod(0o755)
    r = run(cfg, home, "submit", "--json", str(script))
    job = json.loads(r.stdout)
    assert (job["image"], job["sources"]["image"]) == (HAVE, "#GPUFLEX")
    plain = json.loads(run(cfg, home, "submit", "--after", "1", "--json", "--", "true").stdout)
    assert plain["image"] is None
    assert db_rows(home / "g.db", "SELECT id, image FROM jobs WHERE id > 1") == [(2, HAVE), (3, HAVE), (4, None)]


def test_each_host_gets_its_engine_and_its_words(home):
    cfg = write_config(home, extra='container = "docker"\ncontainer_args = ["-v", "/data:/data:ro"]\n')
    host = load_config(str(cfg)).host("local")
    assert launch.container_spec(host, Job(image=HAVE)) == {"engine": "docker", "image": HAVE,
                                                            "args": ["-v", "/data:/data:ro"]}
    assert launch.container_spec(host, Job(image=None)) is None


class FakeTransport:
    def __init__(self, host, result: CommandResult) -> None:
        self.host, self.result, self.ran = host, result, []

    def run(self, argv, *, input=None, timeout=None):
        self.ran.append(argv)
        return self.result


@pytest.mark.parametrize("rc,reason", [(0, None), (1, "podman has no image 'localhost/train:1'"),
                                       (127, "the container engine podman is not installed there")])
def test_a_remote_host_is_asked_at_launch_with_a_clear_reason(home, rc, reason):
    cfg = write_config(home, extra='\n[[hosts]]\nname = "far"\naddress = "far.lab"\ngpus = "cpu:2"\n')
    t = FakeTransport(load_config(str(cfg)).host("far"), CommandResult(rc, "", "bash: podman: command not found"))
    if reason is None:
        launch.check_remote_image(t, HAVE)
    else:
        with pytest.raises(TransportError, match=reason):
            launch.check_remote_image(t, HAVE)
    assert t.ran == [["podman", "image", "exists", HAVE]]
