"""`tpflex-demo`: the end-to-end story on one machine (etcd, controller, simulated agents,
a real 8-process gloo training job), and the building blocks the e2e tests reuse."""
