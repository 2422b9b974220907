"""Aids for the tests and the benchmark, not used by the model: decoding without the cache, and
each hypothesis's own cached keys and values."""
