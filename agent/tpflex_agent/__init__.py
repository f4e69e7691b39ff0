"""tpflex node agent: GPU backends (NVML, simulated), power/clock control, health
reporting to etcd, the agent gRPC service and metrics."""

__version__ = "0.1.0"
