"""Benchmarks (`make bench`): scenarios built on the library, their report, and nothing that
the product imports."""
