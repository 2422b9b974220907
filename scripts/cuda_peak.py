"""The most GPU memory a fairseq command allocated at once, for scripts/benchmark.py: call
``switch_on()`` in the process before fairseq's CLI runs; the figure is printed at exit.

torch.cuda.max_memory_allocated() alone does not give it: fairseq's trainer calls
torch.cuda.reset_peak_memory_stats() after every training step (trainer.py, to log gb_free),
so at exit the counter holds only what came after the last step. switch_on() wraps that reset
so that it keeps the highest reading first. Imports torch only.
"""

import atexit

PRINTED = "cuda peak MB"  # what the line at exit starts with (then MiB)


def switch_on(cuda=None):
    """Start counting from here (CUDA set up first, so that its own buffers count as before);
    returns the function that gives the peak in MiB, which also prints at exit. ``cuda``:
    torch.cuda, or a stand-in with its four functions (tests)."""
    if cuda is None:
        import torch
        cuda = torch.cuda
        x = torch.ones(64, 64, device="cuda", dtype=torch.half)
        x @ x  # the context and cuBLAS's workspace before the count starts
    reset = cuda.reset_peak_memory_stats
    cuda.synchronize()
    reset()
    highest = 0  # bytes: the peak before the last reset

    def reset_keeping_the_peak(*args, **kwargs):
        nonlocal highest
        highest = max(highest, cuda.max_memory_allocated())
        reset(*args, **kwargs)

    def peak_mib() -> float:
        return max(highest, cuda.max_memory_allocated()) / 2 ** 20

    cuda.reset_peak_memory_stats = reset_keeping_the_peak
    atexit.register(lambda: print(PRINTED, peak_mib(), flush=True))
    return peak_mib
