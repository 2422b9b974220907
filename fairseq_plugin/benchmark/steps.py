"""Training steps of the contestants in this process, alternated step by step on the same batches:
step times with less noise than whole commands, and what each step keeps and holds (memory.py).
(scripts/profile_steps.py profiles such steps with torch.profiler.)"""

import itertools
import time

from .common import OURS, alternated, fairseq_setup, training_flags
from .memory import print_memory, step_peak_counter


def fairseq_trainer(flags):
    """fairseq's Trainer built in this process from fairseq-train's command-line flags."""
    from fairseq.trainer import Trainer

    cfg, task = fairseq_setup(flags)
    task.load_dataset("train")
    return Trainer(cfg, task, task.build_model(cfg.model), task.build_criterion(cfg.criterion))


def timed_step(trainer, sample, device) -> float:
    """Seconds of one training step of ``sample``, on a GPU until its kernels have run."""
    import torch

    start = time.perf_counter()
    trainer.train_step([sample])
    if device.kind == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def steps_in_process(data_bin, contestants, preset, max_tokens, steps, device,
                     warm_up_epoch=False):
    """``steps`` training steps of each contestant on the same batches, alternated step by step
    (A B, B A, ...) so that the machine's drift falls on all alike, after a warm-up of 3 batches
    (``warm_up_epoch``: a whole epoch's, so that every batch shape has been seen: cuDNN's plans,
    compiled graphs). Then what a step keeps and holds on the timed batch with the most target
    padding and on the one with the most positions. Returns ({name: [seconds of each timed
    step]}, their target words)."""
    trainers = {c.name: fairseq_trainer(training_flags(data_bin, c, preset, max_tokens, device))
                for c in contestants}
    warm_up = len(trainers[OURS].get_train_iterator(epoch=1)) if warm_up_epoch else 3
    samples = list(itertools.islice(epochs_of_batches(trainers[OURS]), warm_up + steps))
    seconds = {name: [] for name in trainers}
    for i, sample in enumerate(samples):
        for name in alternated(list(trainers), i):
            seconds[name].append(timed_step(trainers[name], sample, device))
    print(f"\nwarm-up, {warm_up} batches each (compiling, cuDNN's plans for new shapes): "
          + ", ".join(f"{name} {sum(t[:warm_up]):.1f} s" for name, t in seconds.items()),
          flush=True)
    seconds = {name: t[warm_up:] for name, t in seconds.items()}
    samples = samples[warm_up:]
    pad = trainers[OURS].task.target_dictionary.pad()
    padding = [float(s["target"].eq(pad).float().mean()) for s in samples]
    positions = [s["target"].numel() + s["net_input"]["src_tokens"].numel() for s in samples]
    counter = step_peak_counter(device)
    for label, figures in (("target padding", padding), ("positions", positions)):
        most = max(range(len(figures)), key=figures.__getitem__)
        print_memory(trainers, samples[most], f"the timed batch with the most {label} "
                     f"({padding[most]:.1%} target padding, {positions[most]} positions)", counter)
    return seconds, sum(int(s["ntokens"]) for s in samples)


def epochs_of_batches(trainer):
    """The training set's batches, shuffled, epoch after epoch."""
    for epoch in itertools.count(1):
        yield from trainer.get_train_iterator(epoch=epoch).next_epoch_itr(shuffle=True)
