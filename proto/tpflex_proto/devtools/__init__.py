"""Local development tools shared by the tests, the benchmarks and the demo: a real etcd
on free loopback ports, free-port helpers. Not used by production code paths."""
