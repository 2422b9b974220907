"""The most tensor memory held at once on the CPU, for the benchmark: what
cuda_peak.PeakCounter reads from torch.cuda's allocator on a GPU, counted here by watching
tensors' storages. The process's resident memory cannot say what one training step holds: the
C library keeps freed memory, and the set-up's peak hides the step's.

``StorageTrace`` is a TorchDispatchMode (the idea of torch's own MemTracker,
torch.distributed._tools, whose interface is private): every storage that an operator's result
brings is noted with the Python line that asked for it, and a weak reference to the storage
notes when it is freed. The notes have the form of torch.cuda's memory history ("alloc",
"free_requested": address, size, frames), so cuda_peak.live_at_peak replays them as it replays
the GPU's. What it sees: storages made by torch's operators, autograd's backward included (on
the CPU it runs in the calling thread), counted by their bytes. What it does not: a kernel's
scratch memory freed before the operator returns, tensors made outside torch's dispatcher
(from_numpy), the allocator's rounding. Storages alive when the trace starts are found among
Python's objects (the parameters, their gradients, the optimizer's state): one of them freed
inside counts negative, as on a GPU. Imports torch (and cuda_peak).
"""

import gc
import sys
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from . import cuda_peak


UNSUPPORTED = ("storage_peak: this torch's storages do not keep their Python object (torch 2.13's "
               "do, 2.1.2's do not), so their freeing cannot be watched")


def storages_keep_their_python_object() -> bool:
    """Whether a storage's Python object lives as long as the storage (then a weak reference to
    it says when the storage is freed)."""
    t = torch.ones(1)
    return t.untyped_storage() is t.untyped_storage()


class StorageTrace(TorchDispatchMode):
    """Inside, notes each storage that an operator's result brings and each such storage's
    freeing (``entries``, in torch.cuda's memory history's form), and the freeing of those alive
    on entering. ``stacks``: note the Python frames of each new storage (slower)."""

    def __init__(self, stacks: bool = True):
        if not storages_keep_their_python_object():
            raise RuntimeError(UNSUPPORTED)
        super().__init__()
        self.entries, self.stacks = [], stacks
        self.watched = {}  # a storage's key: the weak reference that notes its freeing

    def __enter__(self):
        for obj in gc.get_objects():
            if issubclass(type(obj), torch.Tensor):  # (isinstance would ask proxies)
                self.watch(obj.untyped_storage(), frames=None)
        return super().__enter__()

    def __exit__(self, *exc):
        self.watched.clear()  # their references go: no notes after leaving
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        unseen = [t.untyped_storage() for t in tree_flatten(out)[0]
                  if isinstance(t, torch.Tensor) and key(t.untyped_storage()) not in self.watched]
        if unseen:
            # a result on an argument's storage (a view, an in-place result) is not new
            given = {key(t.untyped_storage()) for t in tree_flatten((args, kwargs))[0]
                     if isinstance(t, torch.Tensor)}
            frames = python_frames(sys._getframe(1)) if self.stacks else []
            for storage in unseen:
                if key(storage) not in given:
                    self.watch(storage, frames)
        return out

    def watch(self, storage, frames) -> None:
        """Note ``storage`` (new with ``frames``; None: alive on entering) and, later, its freeing."""
        size = storage.nbytes()
        if key(storage) in self.watched or size == 0 or storage.device.type == "meta":
            return
        if frames is not None:
            self.entries.append({"action": "alloc", "addr": key(storage), "size": size,
                                 "frames": frames})
        self.watched[key(storage)] = weakref.ref(storage, lambda _, k=key(storage), n=size:
                                                 self.freed(k, n))

    def freed(self, storage_key: int, size: int) -> None:
        if self.watched.pop(storage_key, None) is not None:
            self.entries.append({"action": "free_requested", "addr": storage_key, "size": size})


def key(storage) -> int:
    """What tells storages apart while they live: the address of torch's StorageImpl."""
    return storage._cdata


def python_frames(frame):
    """The Python stack from ``frame`` outwards, as torch.cuda's memory history gives it."""
    frames = []
    while frame is not None:
        frames.append({"filename": frame.f_code.co_filename, "line": frame.f_lineno,
                       "name": frame.f_code.co_name})
        frame = frame.f_back
    return frames


class StoragePeakCounter:
    """cuda_peak.PeakCounter's readings around a stretch of work, on the CPU (StorageTrace)."""

    def peak_of(self, work) -> int:
        """The most bytes held at once while ``work()`` runs, beyond what was held before it."""
        return self.live_at_peak_of(work, stacks=False)[0]

    def live_at_peak_of(self, work, stacks: bool = True):
        """(peak_of(work), {the line that allocated it: bytes live at that peak}), as
        cuda_peak.PeakCounter.live_at_peak_of (without ``stacks``, faster: every line '')."""
        trace = StorageTrace(stacks)
        with trace:
            work()
        return cuda_peak.live_at_peak(trace.entries, where=cuda_peak.allocating_line if stacks
                                      else lambda frames: "")
