"""What one training step asks of the device, counted by operation rather than timed: the tensor
operations it launches and the values it reads back to the host, for the forward (with the loss),
the backward and the whole step (the update and fairseq's bookkeeping too).

Where the batch is small for the device, a GPU finishes each kernel before the host has launched
the next (a few microseconds of host time per launch, whatever its size), and every read waits
until the device has run all that was queued before it: these counts, not the arithmetic, then
set the pace. They are the same on every device (testing/operations.py counts them), so the CPU
shows what a GPU's small batches will pay. The update is the exception: on the CPU in fp32
fairseq's Adam loops over the parameters, with --fp16/--bf16 over one flat tensor.
"""

import contextlib

from fairseq_plugin.testing.operations import OperationCounter

from .common import COMPILED

PARTS = ("forward and loss", "backward", "whole step")


def count_step(trainer, sample) -> dict:
    """{part: (launches, reads)} of one training step of ``sample`` (it updates the model)."""
    counts = {}

    @contextlib.contextmanager
    def counting(part):
        with OperationCounter() as counter:
            yield
        counts[part] = (counter.launches, counter.reads)

    criterion, optimizer = trainer.criterion, trainer.optimizer
    forward, backward = criterion.forward, optimizer.backward

    def counted_forward(*args, **kwargs):
        with counting(PARTS[0]):
            return forward(*args, **kwargs)

    def counted_backward(*args, **kwargs):
        with counting(PARTS[1]):
            return backward(*args, **kwargs)

    criterion.forward, optimizer.backward = counted_forward, counted_backward  # over the class's
    try:
        with counting(PARTS[2]):
            trainer.train_step([sample])
    finally:
        del criterion.forward, optimizer.backward
    return counts


def print_launches(trainers, sample, batch: str):
    """Each model's counts for one training step of ``sample`` (the compiled model's are left
    out: its fused kernels are not operations that can be counted this way)."""
    counted = {name: count_step(trainer, sample) for name, trainer in trainers.items()
               if name != COMPILED}
    print(f"\noperations launched / values read back by one training step of {batch}:")
    for name, counts in counted.items():
        print(f"  {name}: " + ", ".join(f"{part} {counts[part][0]} / {counts[part][1]}"
                                        for part in PARTS))
