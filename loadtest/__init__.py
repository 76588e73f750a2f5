"""Benchmarks of the gateway's own cost: a minimal-CPU stub engine, a load generator and the overhead runs."""
