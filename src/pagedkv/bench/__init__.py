"""Benchmarks behind `pagedkv bench ...`. They print a table and write JSON; they never assert."""
