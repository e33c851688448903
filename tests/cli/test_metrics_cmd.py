"""gpuflex.cli.metrics_cmd: `gpuflex metrics`, Prometheus' text format on stdout."""

from __future__ import annotations

import builtins

from gpuflex.cli import metrics_cmd  # noqa: F401 (the module under test, run through the CLI)
from tests.clirun import invoke


def test_the_pool_is_printed_in_the_exposition_format(home, config_path):
    r = invoke(home, config_path, "metrics")
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert any(line.startswith("# TYPE gpuflex_") for line in lines)
    samples = [line for line in lines if line and not line.startswith("#")]
    assert samples and all(line.startswith("gpuflex_") for line in samples)


def test_without_prometheus_client_it_says_what_to_install(home, config_path, monkeypatch):
    real = builtins.__import__

    def no_prometheus(name, *args, **kwargs):
        if name == "gpuflex.control.metrics" or name.startswith("prometheus_client"):
            raise ModuleNotFoundError("No module named 'prometheus_client'", name="prometheus_client")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_prometheus)
    r = invoke(home, config_path, "metrics", "--no-refresh")
    assert r.exit_code == 2
    assert "gpuflex metrics needs the prometheus_client package" in r.stderr
