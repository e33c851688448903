"""A throw-away Prometheus for the tests: Debian's `prometheus`, started on loopback.

`start(directory, targets)` writes a config that scrapes `targets` (ADDR:PORT, path
/metrics) every second, starts the server on a free 127.0.0.1 port with its data under
`directory`, and waits until it answers; `Prometheus.query` runs a PromQL query through
its HTTP API; `Prometheus.stop` stops it. The Debian package may start a system service
of its own on install: this one is separate (its own port, config and data directory).
`make test` installs the package where it is missing and it runs as root (`make
prometheus`); elsewhere the tests that need it skip.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

START_TIMEOUT_S = 60
MISSING = "Debian's prometheus is not installed (make test installs it where it runs as root with apt-get)"


def missing_reason() -> str | None:
    """Why no Prometheus can be started here (its binary or promtool is missing), or None."""
    return MISSING if shutil.which("prometheus") is None or shutil.which("promtool") is None else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class Prometheus:
    process: subprocess.Popen
    url: str
    log: Path

    def query(self, promql: str) -> list[dict[str, Any]]:
        """The result vector of an instant query (/api/v1/query)."""
        q = urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(f"{self.url}/api/v1/query?{q}", timeout=10) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return body["data"]["result"]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)


def start(directory: Path, targets: list[str]) -> Prometheus:
    """A Prometheus scraping `targets` every second (see the module docstring)."""
    directory.mkdir(parents=True, exist_ok=True)
    config = directory / "prometheus.yml"
    config.write_text("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n"
                      "scrape_configs:\n  - job_name: gpuflex\n    static_configs:\n"
                      f"      - targets: {json.dumps(targets)}\n")
    port = free_port()
    log = directory / "prometheus.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(["prometheus", f"--config.file={config}", f"--storage.tsdb.path={directory / 'data'}",
                                    f"--web.listen-address=127.0.0.1:{port}"],
                                   stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    prom = Prometheus(process, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            with urllib.request.urlopen(f"{prom.url}/-/ready", timeout=5) as r:
                if r.status == 200:
                    return prom
        except OSError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            prom.stop()
            raise RuntimeError(f"prometheus did not start: {log.read_text()[-2000:]}")
        time.sleep(0.2)
