"""tpflex controller: etcd-backed cluster state, the NTP planner, leader election,
the reconcile loop, the REST API, metrics, `tpflexctl` and `tpflex-sim`."""

__version__ = "0.1.0"
