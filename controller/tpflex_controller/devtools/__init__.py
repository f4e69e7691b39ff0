"""Local development tools shared by the tests, the benchmarks and the demo: a real etcd
on free loopback ports, development certificates and etcd auth, free-port helpers. Not
used by production code paths.

They ship in the controller's wheel (control-plane hosts; the trainer's ``demo`` extra
requires it), not in the wheels that GPU nodes install (tpflex-proto, tpflex-agent,
tpflex-trainer)."""
