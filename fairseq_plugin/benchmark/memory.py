"""What one training step holds: what its forward keeps for backward (by the operator that made
it), and its peak beyond what was allocated before it: child.PeakCounter on a GPU; on the CPU,
whose resident memory cannot say it, ``StorageTrace`` (the idea of torch's MemTracker, whose
interface is private): it counts the storages of operators' results, autograd's backward
included, until a weak reference says each is freed (not a kernel's scratch memory, tensors made
outside torch's dispatcher, or the allocator's rounding)."""

import gc
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .common import OURS, THEIRS

UNSUPPORTED = ("storage_peak: this torch's storages do not keep their Python object (torch 2.13's "
               "do, 2.1.2's do not), so their freeing cannot be watched")


def storages_keep_their_python_object() -> bool:
    """Whether a storage's Python object lives as long as the storage (then a weak reference to
    it says when the storage is freed)."""
    t = torch.ones(1)
    return t.untyped_storage() is t.untyped_storage()


class StorageTrace(TorchDispatchMode):
    """Inside, counts the bytes of the storages that operators' results bring, until each is
    freed: ``peak``, the most held at once beyond what was held on entering (a storage alive on
    entering and freed inside counts negative, as torch.cuda's allocator counts it)."""

    def __init__(self):
        if not storages_keep_their_python_object():
            raise RuntimeError(UNSUPPORTED)
        super().__init__()
        self.held = self.peak = 0
        self.watched = {}  # StorageImpl's address: the weak reference that notes its freeing

    def __enter__(self):
        for obj in gc.get_objects():
            if issubclass(type(obj), torch.Tensor):  # (isinstance would ask proxies)
                self.watch(obj.untyped_storage(), new=False)
        return super().__enter__()

    def __exit__(self, *exc):
        self.watched.clear()  # their references go: no counting after leaving
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # a result on an argument's storage (a view, an in-place result) is not new
        given = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0]
                 if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in given:
                self.watch(t.untyped_storage(), new=True)
        return out

    def watch(self, storage, new: bool) -> None:
        key, size = storage._cdata, storage.nbytes()
        if key in self.watched or size == 0 or storage.device.type == "meta":
            return
        if new:
            self.count(size)
        self.watched[key] = weakref.ref(storage, lambda _: self.freed(key, size))

    def freed(self, key: int, size: int) -> None:
        if self.watched.pop(key, None) is not None:
            self.count(-size)

    def count(self, n_bytes: int) -> None:
        self.held += n_bytes
        self.peak = max(self.peak, self.held)


class StoragePeakCounter:
    """child.PeakCounter's peak_of on the CPU: the most bytes held at once while ``work()`` runs,
    beyond what was held before it."""

    def peak_of(self, work) -> int:
        with StorageTrace() as trace:
            work()
        return trace.peak


def step_peak_counter(device):
    """What reads one step's peak on ``device``, or None (and why, printed) where nothing can."""
    if device.kind == "cuda":
        from .child import PeakCounter
        return PeakCounter()
    if storages_keep_their_python_object():
        return StoragePeakCounter()
    print(f"\n(no step peaks on the CPU: {UNSUPPORTED})")
    return None


def print_memory(trainers, sample, batch: str, counter=None, rows: int = 8) -> None:
    """What each model's training forward of ``sample`` keeps for backward, in all and by the
    operators that made it (the ``rows`` where ours and fairseq's differ most), and with a
    ``counter`` what one training step of it holds at its peak beyond what was allocated before
    (the parameters, the optimizer's state): where models of the same parameters differ."""
    kept = {name: kept_for_backward(trainer, sample) for name, trainer in trainers.items()}
    mib = {name: sum(by_maker.values()) for name, by_maker in kept.items()}
    print(f"\nkept for backward by one training forward of {batch} (distinct storages, parameters "
          "excluded): " + ", ".join(f"{name} {m:.1f} MiB" for name, m in mib.items())
          + f"; {OURS} / {THEIRS}: {mib[OURS] / mib[THEIRS]:.2f}x")
    makers = sorted(set(kept[OURS]) | set(kept[THEIRS]),
                    key=lambda k: -abs(kept[OURS].get(k, 0.0) - kept[THEIRS].get(k, 0.0)))
    print(f"| made by (grad_fn, dtype) | {OURS}, MiB | {THEIRS}, MiB |\n|---|---|---|")
    for maker in makers[:rows]:
        print(f"| {maker} | {kept[OURS].get(maker, 0.0):.1f} | {kept[THEIRS].get(maker, 0.0):.1f} |")
    if counter is not None:
        peak = {name: counter.peak_of(lambda: trainer.train_step([sample])) / 2 ** 20
                for name, trainer in trainers.items()}
        print("held at its peak by one training step of that batch (forward, backward, update), "
              "beyond what was allocated before it: " + ", ".join(
                  f"{name} {m:.1f} MiB" for name, m in peak.items())
              + f"; {OURS} / {THEIRS}: {peak[OURS] / peak[THEIRS]:.2f}x")


def kept_for_backward(trainer, sample) -> dict:
    """MiB that autograd keeps for the backward of one training forward (model and criterion) of
    ``sample``, by what made each tensor: {"its grad_fn's name dtype": MiB} ("no grad": made
    outside autograd, e.g. a dropout mask)."""
    sample = trainer._prepare_sample(sample)[0]
    storages = {}

    def keep(t):
        maker = type(t.grad_fn).__name__ if t.grad_fn is not None else (
            "leaf" if t.requires_grad else "no grad")
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = (storage.nbytes(),
                                        f"{maker} {str(t.dtype).replace('torch.', '')}")
        # kept, so that no later tensor reuses the address while counting; detached: a node
        # keeping its own output is a cycle through autograd's C++ that gc cannot free
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        trainer.criterion(trainer.model, sample)
    parameters = {p.untyped_storage().data_ptr() for p in trainer.model.parameters()}
    by_maker = {}
    for ptr, (n_bytes, maker) in storages.items():
        if ptr not in parameters:
            by_maker[maker] = by_maker.get(maker, 0.0) + n_bytes / 2 ** 20
    return by_maker
