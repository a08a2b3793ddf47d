"""Benchmarks behind `dorarl bench ...`: each module exposes `main(argv) -> int`."""
