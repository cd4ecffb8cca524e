"""Benchmarks (see bench/README.md). A package so that ``python -m bench.queues`` can spawn its
worker processes by module name."""
