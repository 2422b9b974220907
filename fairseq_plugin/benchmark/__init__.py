"""annotated-benchmark: speed and memory of annotated_transformer against fairseq's transformer,
side by side, on your hardware (main.py says what it measures and how).

By concern: ``runs`` (fairseq's own commands: fairseq-train, fairseq-generate, and the model
exported to CTranslate2), ``steps`` (training steps of both models in one process),
``decoding`` (beam search in one process, the cache), ``memory`` (what a step keeps and holds:
``cuda_peak`` on a GPU, ``storage_peak`` on the CPU), ``profiling`` (torch.profiler), ``mfu``
(model FLOPs per token and the share of the device's peak), ``report`` (the ratio tables),
``data`` and ``common``. ``cli_process`` runs inside fairseq's commands (with
fairseq_changes.py's bf16 changes where asked).
"""
