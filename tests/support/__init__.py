"""Test support: real servers on loopback for the test suite and benchmarks."""
