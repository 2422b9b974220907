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

from fairseq_plugin.testing.operations import OperationCounter, around_calls

from .common import COMPILED

PARTS = ("forward and loss", "backward", "whole step")


def count_step(trainer, sample) -> dict:
    """{part: (launches, reads)} of one training step of ``sample`` (it updates the model)."""
    counts = {}
    part_of = {"forward": PARTS[0], "backward": PARTS[1]}  # the criterion's, the optimizer's

    @contextlib.contextmanager
    def counting(name):
        with OperationCounter() as counter:
            yield
        counts[part_of.get(name, name)] = (counter.launches, counter.reads)

    with around_calls([(trainer.criterion, "forward"), (trainer.optimizer, "backward")], counting):
        with counting(PARTS[2]):
            trainer.train_step([sample])
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
