"""The most GPU memory allocated at once, for scripts/benchmark.py, also where fairseq's trainer
runs: ``switch_on()`` in a process before fairseq's CLI runs prints the peak of the whole command
at exit; ``PeakCounter`` reads it around any stretch of work (a training step).

torch.cuda.max_memory_allocated() alone does not give it: fairseq's trainer calls
torch.cuda.reset_peak_memory_stats() after every training step (trainer.py, to log gb_free),
so the counter then holds only what came after the last step. PeakCounter wraps that reset so
that it keeps the highest reading first. Imports torch only.
"""

import atexit

PRINTED = "cuda peak MB"  # what the line at exit starts with (then MiB)


class PeakCounter:
    """torch.cuda's peak counter, kept across others' resets of it. ``cuda``: torch.cuda, or a
    stand-in with its functions (tests). Make one per process: it wraps the module's reset."""

    def __init__(self, cuda=None):
        if cuda is None:
            import torch
            cuda = torch.cuda
        self.cuda, self.reset = cuda, cuda.reset_peak_memory_stats
        self.highest = 0  # bytes: the peak before the last reset since start()
        cuda.reset_peak_memory_stats = self.reset_keeping_the_peak

    def reset_keeping_the_peak(self, *args, **kwargs):
        self.highest = max(self.highest, self.cuda.max_memory_allocated())
        self.reset(*args, **kwargs)

    def start(self) -> int:
        """Count from now on; returns the bytes allocated now."""
        self.cuda.synchronize()
        self.reset()
        self.highest = 0
        return self.cuda.memory_allocated()

    def peak(self) -> int:
        """The most bytes allocated at once since start()."""
        self.cuda.synchronize()
        return max(self.highest, self.cuda.max_memory_allocated())


def switch_on(cuda=None) -> PeakCounter:
    """Count from here to the process's exit, which prints the peak in MiB (CUDA and cuBLAS set
    up first with a matrix product, so that their own buffers count as before)."""
    if cuda is None:
        import torch
        x = torch.ones(64, 64, device="cuda", dtype=torch.half)
        x @ x
    counter = PeakCounter(cuda)
    counter.start()
    atexit.register(lambda: print(PRINTED, counter.peak() / 2 ** 20, flush=True))
    return counter
