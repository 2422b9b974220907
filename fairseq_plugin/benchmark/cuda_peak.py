"""The most GPU memory allocated at once, for the benchmark, also where fairseq's trainer
runs: ``switch_on()`` in a process before fairseq's CLI runs prints the peak of the whole command
at exit; ``PeakCounter`` reads it around any stretch of work (a training step), and says what
was live at the peak of one (``live_at_peak_of``).

torch.cuda.max_memory_allocated() alone does not give it: fairseq's trainer calls
torch.cuda.reset_peak_memory_stats() after every training step (trainer.py, to log gb_free),
so the counter then holds only what came after the last step. PeakCounter wraps that reset so
that it keeps the highest reading first, and notes in which step it came and what stayed
allocated between steps (the parameters, their gradients, the optimizer's state). Imports torch
only.
"""

import atexit
import os

PRINTED = "cuda peak MB"  # what the line at exit starts with (then MiB, then where it came)
BEFORE = "(allocated before, freed during it)"  # live_at_peak's row for memory freed
NO_FRAME = "(no Python frame: autograd's backward, or C++)"


class PeakCounter:
    """torch.cuda's peak counter, kept across others' resets of it. ``cuda``: torch.cuda, or a
    stand-in with its functions (tests). Make one per process: it wraps the module's reset."""

    def __init__(self, cuda=None):
        if cuda is None:
            import torch
            cuda = torch.cuda
        self.cuda, self.reset = cuda, cuda.reset_peak_memory_stats
        self.highest = 0  # bytes: the peak before the last reset since start()
        self.resets = 0  # others' resets since start(): fairseq's, one after each training step
        self.highest_after = 0  # how many resets came before the highest reading
        self.between = None  # bytes allocated at the last reset (between two training steps)
        cuda.reset_peak_memory_stats = self.reset_keeping_the_peak

    def reset_keeping_the_peak(self, *args, **kwargs):
        reading = self.cuda.max_memory_allocated()
        if reading > self.highest:
            self.highest, self.highest_after = reading, self.resets
        self.resets += 1
        self.between = self.cuda.memory_allocated()
        self.reset(*args, **kwargs)

    def start(self) -> int:
        """Count from now on; returns the bytes allocated now."""
        self.cuda.synchronize()
        self.reset()
        self.highest = self.resets = self.highest_after = 0
        self.between = None
        return self.cuda.memory_allocated()

    def peak(self) -> int:
        """The most bytes allocated at once since start()."""
        self.cuda.synchronize()
        return max(self.highest, self.cuda.max_memory_allocated())

    def peak_of(self, work) -> int:
        """The most bytes allocated at once while ``work()`` runs, beyond what was allocated
        before it."""
        before = self.start()
        work()
        return self.peak() - before

    def where(self) -> str:
        """When the peak came, counting others' resets of the counter as fairseq's trainer makes
        them, one at the end of every training step: 'in training step k of n' (step 1 includes
        the set-up before it), or 'after the last training step' (saving, the end); and what
        was allocated at the last reset."""
        if self.resets == 0:
            return "(no training step)"
        when = ("after the last training step" if self.cuda.max_memory_allocated() > self.highest
                else f"in training step {self.highest_after + 1} of {self.resets}")
        return f"{when}; {self.between / 2 ** 20:.1f} MB allocated between steps"

    def live_at_peak_of(self, work):
        """Runs ``work()`` with torch.cuda's memory history recorded; returns live_at_peak of
        what it allocated and freed: (the most bytes allocated at once beyond what was allocated
        before, {where allocated: bytes live then})."""
        memory = self.cuda.memory
        device = self.cuda.current_device()
        self.cuda.synchronize()
        memory._record_memory_history("all", stacks="python")
        try:
            # the history may hold earlier recordings' entries: only those after this point
            first = len(memory._snapshot()["device_traces"][device])
            work()
            self.cuda.synchronize()
            entries = memory._snapshot()["device_traces"][device][first:]
        finally:
            memory._record_memory_history(None)
        return live_at_peak(entries)


def allocating_line(frames) -> str:
    """The innermost Python frame of an allocation outside torch's own files (the model's or
    fairseq's line that asked for the tensor): 'package/folder/file.py:line function'."""
    for frame in frames:
        path = frame["filename"]
        if f"{os.sep}torch{os.sep}" not in path and not path.startswith("<"):
            return f"{'/'.join(path.split(os.sep)[-3:])}:{frame['line']} {frame['name']}"
    return NO_FRAME


def live_at_peak(entries, where=allocating_line):
    """Replays torch.cuda's memory trace ``entries`` (a snapshot's "device_traces" for one device:
    "alloc" and "free_requested" with "addr", "size" and "frames"; other actions are ignored):
    returns (the most bytes allocated at once beyond what was allocated before the trace, {where
    allocated: bytes live then}). Blocks allocated before the trace and freed in it count
    negative, under BEFORE, so that the peak falls where the allocator's did."""
    live, by_where = {}, {}  # addr: (bytes, where); where: bytes
    total, peak, at_peak = 0, 0, {}
    for entry in entries:
        if entry["action"] == "alloc":
            size, key = entry["size"], where(entry.get("frames", []))
            live[entry["addr"]] = (size, key)
        elif entry["action"] == "free_requested":
            size, key = live.pop(entry["addr"], (entry["size"], BEFORE))
            size = -size
        else:
            continue
        total += size
        by_where[key] = by_where.get(key, 0) + size
        if total > peak:
            peak, at_peak = total, {k: v for k, v in by_where.items() if v}
    return peak, at_peak


def switch_on(cuda=None) -> PeakCounter:
    """Count from here to the process's exit, which prints the peak in MiB and when it came
    (CUDA and cuBLAS set up first with a matrix product, so that their own buffers count as
    before)."""
    if cuda is None:
        import torch
        x = torch.ones(64, 64, device="cuda", dtype=torch.half)
        x @ x
    counter = PeakCounter(cuda)
    counter.start()
    atexit.register(lambda: print(PRINTED, counter.peak() / 2 ** 20, counter.where(), flush=True))
    return counter
