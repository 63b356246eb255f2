"""Benchmarks (GPU): python -m bench.extract, python -m bench.train; --tiny runs a CPU smoke version."""
