"""Fakes for tests and benchmarks: simulated hosts (hosts.py), a fake nvidia-smi, runtime hooks."""
