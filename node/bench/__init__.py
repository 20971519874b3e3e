"""``edgenode bench``: the scenarios (one module each), their statistics and their report.

Every scenario measures the node and, in the same run, a baseline beside it (a raw pyzmq
relay, llama-cpp-python alone, llama-server, the idle host), so figures are read as
ratios to a baseline rather than as absolute numbers (README, "Benchmark").
"""
