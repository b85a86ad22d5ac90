"""`benchmarks`: measuring serving systems from the outside, the way a client sees them.

`serve` is the load generator (`python -m benchmarks.serve`), `compare` the one-run comparison of Conveyor's
scheduling modes, `transformers serve` and the bare-forward ceiling. `streams.py` and `shards.py` are older
standalone scripts, run by path.
"""
