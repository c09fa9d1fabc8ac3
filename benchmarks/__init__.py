"""Benchmark and experiment scripts, run from a checkout as ``python -m benchmarks.<script>``; their numbers are
in ``benchmarks/README.md``. Nothing in ``attnlab`` imports them."""
