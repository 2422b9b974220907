"""Training steps of both models in this process, alternated step by step on the same batches:
step times with less noise than whole commands, and (memory.py, profiling.py, launches.py) what
each step keeps, where its time goes and how many operations it launches."""

import contextlib
import itertools
import time

from fairseq_plugin.cli.common import plugin_dir

from . import cuda_peak
from .common import (COMPILED, CPU, NO_PACKING, OURS, THEIRS, THEIRS_NO_CUDNN, alternated,
                     fairseq_setup, training_flags)
from .launches import print_launches
from .memory import print_live_at_peak, print_memory
from .profiling import print_profiles


def fairseq_trainer(flags):
    """fairseq's Trainer (model, criterion, optimizer) built in this process from fairseq-train's
    command-line flags, and its task."""
    from fairseq.trainer import Trainer

    cfg, task = fairseq_setup(flags)
    task.load_dataset("train")
    return Trainer(cfg, task, task.build_model(cfg.model), task.build_criterion(cfg.criterion))


def steps_in_process(data_bin, preset, max_tokens, steps, profile_steps=0, device=CPU,
                     without_packing=False, memory=None, gpu_paths=False, compiled=False,
                     warm_up_epoch=False, transformer_without_cudnn=False):
    """Training steps of both models in one process on the same batches, alternated step by step
    (A B, B A, ...), so that the machine's drift falls on both alike. Returns ({name: [seconds of
    each step]}, the target words of those steps); with ``profile_steps``, then profiles that
    many steps of each (print_profiles).
    ``without_packing`` adds annotated_transformer computing padding too (NO_PACKING),
    ``compiled`` annotated_transformer with --compile-layers (COMPILED). ``memory``
    reads what one step holds at its peak (step_peak_mib; None: cuda_peak.PeakCounter on a GPU,
    storage_peak.StoragePeakCounter on the CPU where torch allows it).
    ``gpu_paths``: our models take a GPU's paths on the CPU (gpu_paths_on_cpu).
    ``warm_up_epoch``: every model first trains on a whole epoch's batches, untimed, so that each
    batch shape has been seen (cuDNN's attention plans, compiled graphs: the steady state of a
    long run); else on 3 batches. ``transformer_without_cudnn`` adds fairseq's transformer with
    torch's cuDNN attention backend off around its steps (THEIRS_NO_CUDNN)."""
    flags = {arch: training_flags(data_bin, arch, preset, max_tokens, plugin_dir(), device)
             for arch in (OURS, THEIRS)}
    trainers = {arch: fairseq_trainer(flags[arch]) for arch in (OURS, THEIRS)}
    if without_packing:
        trainers[NO_PACKING] = fairseq_trainer(flags[OURS])
        model = trainers[NO_PACKING].model
        model.encoder.skip_padding = model.decoder.skip_padding = False
    if compiled:
        trainers[COMPILED] = fairseq_trainer(flags[OURS] + ["--compile-layers"])
    if transformer_without_cudnn:
        trainers[THEIRS_NO_CUDNN] = WithoutCudnnAttention(fairseq_trainer(flags[THEIRS]))
    warm_up = len(trainers[OURS].get_train_iterator(epoch=1)) if warm_up_epoch else 3
    with gpu_paths_on_cpu(trainers) if gpu_paths else contextlib.nullcontext():
        return alternated_steps(trainers, steps, profile_steps, device, memory, warm_up)


class WithoutCudnnAttention:
    """A fairseq Trainer whose training steps run with torch's cuDNN attention backend off (it
    builds a plan for each new shape; the other backends do not), switched back after each."""

    def __init__(self, trainer):
        self.trainer = trainer

    def __getattr__(self, name):  # model, task, ... as the trainer's
        return getattr(self.trainer, name)

    def train_step(self, samples):
        import torch

        from fairseq_plugin.modules.attention import NO_CUDNN, fused_backends

        # the model's own switch, as on a CUDA device (a torch without cuDNN attention, < 2.2,
        # has nothing to switch)
        with fused_backends(NO_CUDNN, torch.device("cuda")):
            return self.trainer.train_step(samples)



@contextlib.contextmanager
def gpu_paths_on_cpu(trainers):
    """Inside, our models (all but fairseq's) take on the CPU the paths they take on a GPU, so
    that what they keep for backward is as there (--gpu-paths-on-cpu): torch's dropout, as
    fairseq's transformer has, instead of the CPU's cheaper mask (modules/dropout.py), and
    attention's handling of queries that may attend to no key where the fused kernel is not
    certain to zero them (modules/attention.py). The models keep torch's dropout (they serve
    this run only); attention's module-wide setting is restored on leaving."""
    from fairseq_plugin.modules import attention, dropout

    for name, trainer in trainers.items():
        if name != THEIRS:
            for module in trainer.model.modules():
                if isinstance(module, dropout.Dropout):
                    module.cpu_mask = False
    zeroes = attention.fused_kernel_zeroes_empty_rows
    attention.fused_kernel_zeroes_empty_rows = lambda q: False
    try:
        yield
    finally:
        attention.fused_kernel_zeroes_empty_rows = zeroes


def epochs_of_batches(trainer):
    """The training set's batches, shuffled, epoch after epoch (more steps than one epoch has
    batches: large --max-tokens on a small corpus)."""
    for epoch in itertools.count(1):
        yield from trainer.get_train_iterator(epoch=epoch).next_epoch_itr(shuffle=True)


def timed_step(trainer, sample, device) -> float:
    """Seconds of one training step of ``sample``, on a GPU until its kernels have run (none of
    them left to the next step's time)."""
    import torch

    start = time.perf_counter()
    trainer.train_step([sample])
    if device.kind == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def alternated_steps(trainers, steps, profile_steps, device, memory, warm_up=3):
    """steps_in_process's work, once its trainers are built."""
    samples = list(itertools.islice(epochs_of_batches(trainers[OURS]), warm_up + steps))
    warm_up_seconds = {name: 0.0 for name in trainers}
    for i, sample in enumerate(samples[:warm_up]):  # not in the step times
        for name in alternated(list(trainers), i):
            warm_up_seconds[name] += timed_step(trainers[name], sample, device)
    print(f"\nwarm-up, {warm_up} batches each (compiling, cuDNN's plans for new shapes): "
          + ", ".join(f"{name} {t:.1f} s" for name, t in warm_up_seconds.items()), flush=True)
    samples = samples[warm_up:]
    seconds = {name: [] for name in trainers}
    for i, sample in enumerate(samples):
        for name in alternated(list(trainers), i):
            seconds[name].append(timed_step(trainers[name], sample, device))
    if profile_steps:
        print_profiles(trainers, samples[:profile_steps], device)
    # the timed batch with the most target padding (where packing is on, if anywhere) and the
    # one with the most positions (where a run's peak memory is likely)
    pad = trainers[OURS].task.target_dictionary.pad()
    padding = [float(s["target"].eq(pad).float().mean()) for s in samples]
    positions = [s["target"].numel() + s["net_input"]["src_tokens"].numel() for s in samples]
    if memory is None and device.kind == "cuda":
        memory = cuda_peak.PeakCounter()
    elif memory is None:
        from . import storage_peak  # (imports torch)
        if storage_peak.storages_keep_their_python_object():
            memory = storage_peak.StoragePeakCounter()
        else:
            print(f"\n(no step peaks on the CPU: {storage_peak.UNSUPPORTED})")
    batches = {}
    for label, figures in (("target padding", padding), ("positions", positions)):
        most = max(range(len(figures)), key=figures.__getitem__)
        batches[f"the timed batch with the most {label}"] = samples[most]
        print_memory(trainers, samples[most], f"the timed batch with the most {label} "
                     f"({padding[most]:.1%} target padding, {positions[most]} positions)", memory)
    for batch, sample in batches.items():
        print_launches(trainers, sample, batch)
    if memory is not None:  # last: it records every allocation (slower steps)
        for batch, sample in batches.items():
            print_live_at_peak(trainers, sample, batch, memory)
    return seconds, sum(int(s["ntokens"]) for s in samples)
