"""What one training step holds: the activations its forward keeps for backward (by the
operator that made them), its peak beyond what was allocated before it, and what is live at that
peak by the line that allocated it (cuda_peak.py on a GPU, storage_peak.py on the CPU)."""

from .common import OURS, THEIRS


def step_peak_mib(trainer, sample, memory) -> float:
    """MiB that one training step of ``sample`` holds at its peak beyond what was allocated before
    it (the parameters, the optimizer's state): where two models of the same parameters differ in
    peak memory. Whole runs' peaks (train_run) add what stays allocated between steps."""
    return memory.peak_of(lambda: trainer.train_step([sample])) / 2 ** 20


def print_memory(trainers, sample, batch: str, memory=None, rows: int = 8) -> None:
    """What each model's training forward of ``sample`` keeps for backward, in all and by the
    operators that made it (the ``rows`` where the models differ most), and with ``memory`` (on
    a GPU a cuda_peak.PeakCounter, on the CPU a storage_peak.StoragePeakCounter) what one
    training step of it holds at its peak."""
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
    if memory is not None:
        peak = {name: step_peak_mib(trainer, sample, memory) for name, trainer in trainers.items()}
        print("held at its peak by one training step of that batch (forward, backward, update), "
              "beyond what was allocated before it: " + ", ".join(
                  f"{name} {m:.1f} MiB" for name, m in peak.items())
              + f"; {OURS} / {THEIRS}: {peak[OURS] / peak[THEIRS]:.2f}x")


def print_live_at_peak(trainers, sample, batch: str, memory, rows: int = 8) -> None:
    """What is live at the peak of one more training step of ``sample`` by each model
    (``memory``'s live_at_peak_of, as in print_memory): the ``rows`` lines that had allocated
    the most then, and the rest together."""
    for name, trainer in trainers.items():
        peak, by_line = memory.live_at_peak_of(lambda: trainer.train_step([sample]))
        top = sorted(by_line.items(), key=lambda item: -abs(item[1]))
        print(f"\nlive at the peak of {name}'s step of {batch} ({peak / 2 ** 20:.1f} MiB beyond "
              "what was allocated before it), by the line that allocated it:\n"
              "| MiB | allocated at |\n|---|---|")
        for line, n_bytes in top[:rows]:
            print(f"| {n_bytes / 2 ** 20:.1f} | {line} |")
        if len(top) > rows:
            rest = sum(n_bytes for _, n_bytes in top[rows:])
            print(f"| {rest / 2 ** 20:.1f} | {len(top) - rows} other lines |")


def kept_for_backward(trainer, sample) -> dict:
    """MiB of activations that autograd keeps for the backward of one training forward (model
    and criterion) of ``sample`` (most of what training holds at its peak beyond the parameters
    and the optimizer's state), by what made each tensor: {"its grad_fn's name dtype": MiB}
    ("no grad": made outside autograd, e.g. a dropout mask)."""
    import torch

    sample = trainer._prepare_sample(sample)[0]
    storages = {}

    def keep(t):
        maker = type(t.grad_fn).__name__ if t.grad_fn is not None else (
            "leaf" if t.requires_grad else "no grad")
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = (storage.nbytes(),
                                        f"{maker} {str(t.dtype).replace('torch.', '')}")
        # kept (so that no later tensor reuses its storage's address while counting), but
        # detached: a node keeping its own output, with that output's grad_fn the node, is a
        # cycle through autograd's C++ that Python's gc cannot free (the whole forward's
        # activations would stay allocated after it)
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        trainer.criterion(trainer.model, sample)
    parameters = {p.untyped_storage().data_ptr() for p in trainer.model.parameters()}
    by_maker = {}
    for ptr, (n_bytes, maker) in storages.items():
        if ptr not in parameters:
            by_maker[maker] = by_maker.get(maker, 0.0) + n_bytes / 2 ** 20
    return by_maker
