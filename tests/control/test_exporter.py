"""gpuflex.control.exporter: `metrics --serve`'s address parsing, its per-scrape collector
and its HTTP server (on a thread of this process, on loopback)."""

from __future__ import annotations

import socket
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import create_engine
from sqlalchemy.orm import sessionmaker

from gpuflex.config import load_config
from gpuflex.control import exporter
from gpuflex.db.engine import open_database
from gpuflex.errors import UsageError
from gpuflex.states import JobState
from tests import REPO as ROOT
from tests.conftest import write_config


@pytest.mark.parametrize("text, want", [("127.0.0.1:9464", ("127.0.0.1", 9464)), ("0.0.0.0:0", ("0.0.0.0", 0)),
                                        ("[::1]:80", ("::1", 80)), (" localhost:9464 ", ("localhost", 9464))])
def test_an_address_and_port_are_read(text, want):
    assert exporter.parse_bind(text) == want


@pytest.mark.parametrize("text, says", [("9464", "give ADDR:PORT"), (":9464", "give ADDR:PORT"),
                                        ("127.0.0.1:", "the port must be"), ("127.0.0.1:65536", "the port must be"),
                                        ("127.0.0.1:-1", "the port must be"), ("::1:9464", "give ADDR:PORT"),
                                        ("[nope]:9464", "no IPv6 address"), ("", "give ADDR:PORT"),
                                        ("a\x00b:9464", "give ADDR:PORT"), ("\udcff:9464", "give ADDR:PORT"),
                                        ("a b:9464", "give ADDR:PORT"), ("-x:9464", "give ADDR:PORT"),
                                        ("127.0.0.1:²", "the port must be"), ("127.0.0.1:1e3", "the port must be")])
def test_a_bad_bind_is_one_usage_error(text, says):
    with pytest.raises(UsageError, match=says) as e:
        exporter.parse_bind(text)
    assert "\n" not in str(e.value)


def names(collector: exporter.Live) -> dict[str, list]:
    return {f.name: f.samples for f in collector.collect()}


def test_each_scrape_reads_the_database_anew(home):
    cfg = load_config(str(write_config(home)))
    live = exporter.Live(open_database(cfg.database_url), cfg)
    got = names(live)
    assert got["gpuflex_database_up"][0].value == 1
    assert {s.labels["state"] for s in got["gpuflex_jobs_in_state"]} == {s.value for s in JobState}


def test_a_scrape_that_cannot_read_the_database_says_so_in_a_series(home, caplog):
    broken = sessionmaker(bind=create_engine(f"sqlite:///{home / 'empty.db'}"))   # no tables
    got = names(exporter.Live(broken, load_config(str(write_config(home)))))
    assert list(got) == ["gpuflex_database_up"] and got["gpuflex_database_up"][0].value == 0
    assert "could not read the database" in caplog.text


def test_the_server_answers_a_scrape_and_a_taken_or_foreign_address_is_refused(home):
    cfg = load_config(str(write_config(home)))
    sessions = open_database(cfg.database_url)
    server, url = exporter.start(sessions, cfg, "127.0.0.1:0")
    try:
        assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
        with urllib.request.urlopen(url, timeout=30) as r:
            text = r.read().decode()
        families = {f.name for f in text_string_to_metric_families(text)}
        assert {"gpuflex_database_up", "gpuflex_jobs_in_state", "gpuflex_scale_events"} <= families
        with pytest.raises(UsageError, match="the port is in use"):
            exporter.start(sessions, cfg, f"127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()
        server.server_close()
    with pytest.raises(UsageError, match="no interface of this machine has that address"):
        exporter.start(sessions, cfg, "192.0.2.1:0")   # TEST-NET-1: on no machine


def test_a_port_taken_by_another_program_is_refused(home):
    cfg = load_config(str(write_config(home)))
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        with pytest.raises(UsageError, match=r"--bind 127\.0\.0\.1:\d+: cannot listen there: the port is in use"):
            exporter.start(open_database(cfg.database_url), cfg, f"127.0.0.1:{other.getsockname()[1]}")


def test_the_systemd_example_serves_where_the_default_is_and_gives_up_on_bad_input():
    """examples/systemd/gpuflex-metrics.service: its ExecStart is `metrics --serve` on the
    default address, and it does not restart after exit 2 (a bad --bind or a port in use)."""
    unit = (ROOT / "examples/systemd/gpuflex-metrics.service").read_text().splitlines()
    start = next(x for x in unit if x.startswith("ExecStart=")).split()
    assert start[1:] == ["metrics", "--serve", "--bind", exporter.DEFAULT_BIND]
    assert exporter.parse_bind(exporter.DEFAULT_BIND) == ("127.0.0.1", 9464)
    assert "RestartPreventExitStatus=2" in unit and UsageError("x").exit_code == 2
