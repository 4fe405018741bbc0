"""Benchmark modules for ``kvplane bench``."""
