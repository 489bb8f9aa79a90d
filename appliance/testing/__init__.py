"""Harness shared by tests/ and bench/: a server subprocess on loopback (loopback.py) and read-only /proc views
(procinfo.py). The server never imports this package (tests/test_architecture.py checks): it lives here so tests
and bench import the same code without importing each other."""
