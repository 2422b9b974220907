"""annotated-benchmark: speed and memory of annotated_transformer against fairseq's transformer,
side by side, on your hardware (docs/benchmarks.md says what it measures and how).

``main`` (options, the rounds) -> ``runs`` (fairseq's own commands, and CTranslate2), ``steps``
(training steps in one process; ``memory``: what a step keeps and holds), ``decoding`` (beam
search in one process, the cache), ``report`` (tables, MFU), ``data``; all use ``common`` (sizes,
contestants) and ``child`` (the child process that runs one of fairseq's commands).
"""
