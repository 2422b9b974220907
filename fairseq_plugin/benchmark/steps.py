"""Training steps of both models in this process, alternated step by step on the same batches:
step times with less noise than whole commands, and (memory.py, profiling.py) what each step
keeps and where its time goes."""

import contextlib
import itertools
import time

from fairseq_plugin.cli.common import plugin_dir

from . import cuda_peak
from .common import (COMPILED, CPU, NO_PACKING, OURS, THEIRS, alternated, fairseq_setup,
                     training_flags)
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
                     without_packing=False, memory=None, gpu_paths=False, compiled=False):
    """Training steps of both models in one process on the same batches, alternated step by step
    (A B, B A, ...), so that the machine's drift falls on both alike. Returns ({name: [seconds of
    each step]}, the target words of those steps); with ``profile_steps``, then profiles that
    many steps of each (print_profiles).
    ``without_packing`` adds annotated_transformer computing padding too (NO_PACKING),
    ``compiled`` annotated_transformer with --compile-layers (COMPILED). ``memory``
    reads what one step holds at its peak (step_peak_mib; None: cuda_peak.PeakCounter on a GPU,
    storage_peak.StoragePeakCounter on the CPU where torch allows it).
    ``gpu_paths``: our models take a GPU's paths on the CPU (gpu_paths_on_cpu)."""
    flags = {arch: training_flags(data_bin, arch, preset, max_tokens, plugin_dir(), device)
             for arch in (OURS, THEIRS)}
    trainers = {arch: fairseq_trainer(flags[arch]) for arch in (OURS, THEIRS)}
    if without_packing:
        trainers[NO_PACKING] = fairseq_trainer(flags[OURS])
        model = trainers[NO_PACKING].model
        model.encoder.skip_padding = model.decoder.skip_padding = False
    if compiled:
        trainers[COMPILED] = fairseq_trainer(flags[OURS] + ["--compile-layers"])
    with gpu_paths_on_cpu(trainers) if gpu_paths else contextlib.nullcontext():
        return alternated_steps(trainers, max_tokens, steps, profile_steps, device, memory)



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


def alternated_steps(trainers, max_tokens, steps, profile_steps, device, memory):
    """steps_in_process's work, once its trainers are built."""
    import torch

    batches = trainers[OURS].get_train_iterator(epoch=1).next_epoch_itr(shuffle=True)
    samples = list(itertools.islice(batches, 3 + steps))
    if len(samples) < 3 + steps:
        raise SystemExit(f"benchmark: error: --steps-in-process {steps}: the training set has "
                         f"{len(samples)} batches of --max-tokens {max_tokens} (3 of them for "
                         f"warm-up); ask for at most {len(samples) - 3} steps")
    for sample in samples[:3]:  # warm-up
        for trainer in trainers.values():
            trainer.train_step([sample])
    if device.kind == "cuda":
        torch.cuda.synchronize()  # none of the warm-up in the first timed step
    seconds = {name: [] for name in trainers}
    for i, sample in enumerate(samples[3:]):
        for name in alternated(list(trainers), i):
            start = time.perf_counter()
            trainers[name].train_step([sample])
            if device.kind == "cuda":
                torch.cuda.synchronize()
            seconds[name].append(time.perf_counter() - start)
    if profile_steps:
        print_profiles(trainers, samples[3:3 + profile_steps], device)
    # the timed batch with the most target padding (where packing is on, if anywhere) and the
    # one with the most positions (where a run's peak memory is likely)
    pad = trainers[OURS].task.target_dictionary.pad()
    padding = [float(s["target"].eq(pad).float().mean()) for s in samples[3:]]
    positions = [s["target"].numel() + s["net_input"]["src_tokens"].numel() for s in samples[3:]]
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
        batches[f"the timed batch with the most {label}"] = samples[3 + most]
        print_memory(trainers, samples[3 + most], f"the timed batch with the most {label} "
                     f"({padding[most]:.1%} target padding, {positions[most]} positions)", memory)
    if memory is not None:  # last: it records every allocation (slower steps)
        for batch, sample in batches.items():
            print_live_at_peak(trainers, sample, batch, memory)
    return seconds, sum(int(s["ntokens"]) for s in samples[3:])
