"""tpflex-sim: a goodput simulator driving the production planner (see docs/simulator.md)."""
