# The two commands: `make demo` and `make test` (`make test-fast`: the tests that start no
# process or server, see docs/testing.md). Both create or reuse .venv, install the
# CPU build of torch first (pinned, so no CUDA packages are pulled), then gpuflex itself with
# its test extra (the training frameworks the tests run under gpuflex among it), torch held at
# the same pin by a constraints file so that no framework pulls another torch.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
PIP := $(PY) -m pip install --quiet --disable-pip-version-check
TORCH_PIN := $(VENV)/torch-pin.txt
# apt-get update once (not once per missing package): a fresh machine has no package lists
APT_UPDATE := test -e $(VENV)/.apt-updated || { apt-get update -qq && touch $(VENV)/.apt-updated; }

.PHONY: demo test test-fast venv bytecode sshd iptables cc postgresql podman prometheus chromium bench clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	echo "torch==$(TORCH_VERSION)" > $(TORCH_PIN)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) -c $(TORCH_PIN) torch
	$(PIP) -c $(TORCH_PIN) -e ".[test,postgres]"
	touch $@

# Our own sources byte-compiled before the tests, the demo and the benchmarks run: pip
# compiles what it installs, but not an editable checkout, and where PYTHONDONTWRITEBYTECODE
# is set (CI's machines, this project's dev machines) Python never writes the .pyc files
# itself, so every process (each command, coordinator and worker) compiled the gpuflex
# modules it imports again: ~0.25 s of CPU for the whole package. A .pyc whose source
# changed since is not used (Python checks the source's time stamp), so one left stale
# costs only what not having it costs.
bytecode: venv
	$(PY) -m compileall -q -j 0 gpuflex examples benchmarks tests migrations

# The SSH tests need OpenSSH's sshd; install it where it is missing and we are root (as on CI).
sshd:
	@if command -v sshd >/dev/null 2>&1 || test -x /usr/sbin/sshd; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing openssh-server for the SSH tests"; \
		$(APT_UPDATE) && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server >/dev/null; \
	else echo "sshd not found and not root: the SSH tests will be skipped"; fi

# The partition test (tests/e2e/ssh/test_partition_ssh.py) cuts a host's job processes off with
# iptables rules on loopback; install Debian's iptables where it is missing and we are root.
iptables:
	@if command -v iptables >/dev/null 2>&1 || test -x /usr/sbin/iptables; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing iptables for the partition test"; \
		$(APT_UPDATE) && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iptables >/dev/null; \
	else echo "iptables not found and not root: the partition test will be skipped"; fi

# The clock-skew test (tests/e2e/ssh/test_clock_skew_ssh.py) builds tests/fakes/clockshift.c,
# a host's wall clock set off, with the C compiler; install Debian's gcc where it is missing
# and we are root.
cc:
	@if command -v cc >/dev/null 2>&1 || command -v gcc >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing gcc for the clock-skew test"; \
		$(APT_UPDATE) && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc libc6-dev >/dev/null; \
	else echo "no C compiler and not root: the clock-skew test will be skipped"; fi

# The PostgreSQL tests start a throw-away cluster of Debian's postgresql (tests/pgbed.py);
# install it where it is missing and we are root (as on CI).
postgresql:
	@if command -v initdb >/dev/null 2>&1 || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing postgresql for the PostgreSQL tests"; \
		$(APT_UPDATE) && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null; \
	else echo "postgresql not found and not root: the PostgreSQL tests will be skipped"; fi

# The container tests (submit --image) run podman; install it where it is missing and we are
# root (as on CI), with runc: crun refuses a cgroup v1 host that has a cgroup v2 hierarchy
# beside it, and tests/podbed.py falls back to runc there.
podman:
	@if command -v podman >/dev/null 2>&1 && command -v runc >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing podman for the container tests"; \
		$(APT_UPDATE) && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman runc >/dev/null; \
	else echo "podman not found and not root: the container tests will be skipped"; fi

# The metrics test scrapes `gpuflex metrics --serve` with a real Prometheus and checks the
# text with promtool (tests/prombed.py starts its own on loopback; a system service the
# package may start is not used); install it where it is missing and we are root (as on CI).
prometheus:
	@if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing prometheus for the metrics test"; \
		$(APT_UPDATE) && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null; \
	else echo "prometheus not found and not root: the metrics test will be skipped"; fi

# The browser test of `gpuflex web` (tests/e2e/test_web_browser.py) drives Debian's chromium
# through Selenium and Debian's chromium-driver (which matches its version: no browser is
# downloaded); install them where they are missing and we are root (as on CI).
chromium:
	@if test -x /usr/bin/chromium && test -x /usr/bin/chromedriver; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing chromium and chromium-driver for the browser test"; \
		$(APT_UPDATE) && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; \
	else echo "chromium or chromium-driver not found and not root: the browser test will be skipped"; fi

# TEST_WORKERS=2: the suite on two pytest workers (pytest-xdist), a file's tests on one worker,
# the heaviest files first (tests/tiers.py). Not the default: on the 2-core machine the suite is
# CPU-bound on its jobs' torch processes, so two workers took 56 min 37 s against ~61 min
# serially, and one end-to-end test failed under that load (docs/testing.md). 0: in this
# process, one test at a time (also for -s or pdb). --durations: the 40 slowest tests are
# printed at the end, so that a run (CI's included) says where the suite's time went.
TEST_WORKERS ?= 0
test: venv bytecode sshd iptables cc postgresql podman prometheus chromium
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=40 $(PYTEST_ARGS)

# The tests that start no process or server: the markers are tests/tiers.py's. On two pytest
# workers (FAST_WORKERS), each test sent to whichever worker is free: 104 s against 170 s in
# one process on the idle 2-core machine; none of them waits on a job's pace.
FAST_WORKERS ?= 2
test-fast: venv bytecode
	$(PY) -m pytest -q -n $(FAST_WORKERS) -m "not (e2e or ssh or postgres or slow)" $(PYTEST_ARGS)

demo: venv bytecode
	$(PY) examples/demo.py

bench: venv bytecode sshd postgresql
	$(PY) benchmarks/scale_pause.py
	$(PY) benchmarks/steady_overhead.py
	$(PY) benchmarks/probe_hosts.py
	$(PY) benchmarks/harvest_trace.py
	$(PY) benchmarks/control_plane.py
	$(PY) benchmarks/split_exactness.py

clean:
	rm -rf .demo build *.egg-info
