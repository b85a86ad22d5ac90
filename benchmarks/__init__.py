"""`benchmarks`: measuring serving systems from the outside, the way a client sees them.

`serve` is the load generator (`python -m benchmarks.serve`), `compare` the one-run comparison of Conveyor's
scheduling modes with vLLM's CPU build, llama.cpp, `transformers serve` and the bare-forward ceiling; the
others each measure one thing (`make bench` runs them all).
"""
