"""Benchmarking: workloads, the driver that honours arrivals, baselines, metrics and reports."""
