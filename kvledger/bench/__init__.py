"""Benchmarks, workloads, trace replay and the cluster simulator (`kvledger bench ...`)."""
