"""Pipeline mode against data parallelism, emulated (issue 14 item 7): ``python -m benchmarks.pipeline``."""
