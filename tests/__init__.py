"""The test suite: unit tests in folders that mirror the package (tests/elastic/coordinator/
tests gpuflex/elastic/coordinator/), tests that start jobs or processes in tests/e2e/ (over
the sshd bed: tests/e2e/ssh/); docs/testing.md, "Where the tests are"."""

from pathlib import Path

# Paths from here, not from each test file's own __file__, which means something else one or
# two folders down.
TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
