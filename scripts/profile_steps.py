"""Where a training step's time goes: torch.profiler's operators of K training steps of each
contestant (the benchmark's, fairseq's Trainers in this process), alternated step by step on the
same batches after 3 warm-up batches each; the matrix products' time and FLOPs, and on a GPU the
share of the steps' wall time the GPU was busy.

  python scripts/profile_steps.py --data-bin DATA_BIN [--steps 10] [--preset base] \
      [--max-tokens 8192] [--device cuda --precision bf16] [--contestants ...]

The same options as annotated-benchmark's; docs/benchmarks.md gives what it found.
"""

import argparse
import itertools

from fairseq_plugin import fairseq_changes
from fairseq_plugin.benchmark.child import Device
from fairseq_plugin.benchmark.common import (OURS, PRESETS, alternated, contestants,
                                             training_flags)
from fairseq_plugin.benchmark.steps import epochs_of_batches, fairseq_trainer, timed_step

MATRIX_PRODUCTS = ("aten::mm", "aten::addmm")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-bin", required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--preset", choices=sorted(PRESETS), default="default")
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--precision", choices=["fp32", "fp16", "bf16"])
    p.add_argument("--contestants", type=contestants, default="annotated_transformer,transformer")
    args = p.parse_args(argv)
    device = Device(args.device, args.precision or ("fp32" if args.device == "cpu" else "fp16"))
    if device.precision == "bf16":
        fairseq_changes.install([change.name for change in fairseq_changes.BENCHMARK_BF16])
    trainers = {c.name: fairseq_trainer(training_flags(args.data_bin, c, args.preset,
                                                       args.max_tokens, device))
                for c in args.contestants}
    samples = list(itertools.islice(epochs_of_batches(trainers[OURS]), 3 + args.steps))
    for i, sample in enumerate(samples[:3]):  # warm-up
        for name in alternated(list(trainers), i):
            timed_step(trainers[name], sample, device)
    print_profiles(trainers, samples[3:], device)


def print_profiles(trainers, samples, device, rows=25):
    """torch.profiler on training steps of each trainer, alternated step by step: the operators
    with the most self time (the CPU's, or on a GPU the GPU's), summed over the steps, and the
    time and FLOPs of the matrix products; on a GPU the share of the steps' wall time the GPU was
    busy (a small share: the host sets the pace), and the operators by the CPU's time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    on_gpu = device.kind == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    totals = {name: {} for name in trainers}  # operator: [self s, calls, FLOPs, self CPU s, CPU s]
    walls = {name: 0.0 for name in trainers}
    for i, sample in enumerate(samples):
        for name in alternated(list(trainers), i):
            with profile(activities=activities, with_flops=True) as prof:
                walls[name] += timed_step(trainers[name], sample, device)
            for e in prof.key_averages():
                if on_gpu and e.device_type != DeviceType.CPU:
                    continue  # a kernel: its GPU time is already the launching operator's
                kept = totals[name].setdefault(e.key, [0.0, 0, 0, 0.0, 0.0])
                kept[0] += (self_gpu_time(e) if on_gpu else e.self_cpu_time_total) / 1e6
                kept[1] += e.count
                kept[2] += e.flops or 0
                kept[3] += e.self_cpu_time_total / 1e6
                kept[4] += e.cpu_time_total / 1e6
    for name, ops in totals.items():
        gemm = [ops.get(key, [0.0] * 5) for key in MATRIX_PRODUCTS]
        busy = sum(t[0] for t in ops.values())
        print(f"\n{name}, {len(samples)} steps profiled: {busy:.2f} s of "
              f"{'GPU' if on_gpu else 'CPU'} time"
              + (f" ({sum(t[3] for t in ops.values()):.2f} s of CPU time)" if on_gpu else "")
              + f" in {walls[name]:.2f} s of wall time"
              + (f" (the GPU busy {busy / walls[name]:.0%} of it)" if on_gpu else "")
              + f", matrix products {sum(t[0] for t in gemm):.2f} s, "
              f"{sum(t[2] for t in gemm) / 1e9:,.1f} GFLOP")
        for key, (spent, calls, *_) in sorted(ops.items(), key=lambda kv: -kv[1][0])[:rows]:
            print(f"  {spent:8.3f} s {calls:7d} calls  {key}")
        if on_gpu:  # small steps wait on the host: where its time goes (nested ones overlap)
            print("  by the CPU's time, with what each calls:")
            for key, (_, calls, _, _, host) in sorted(ops.items(),
                                                      key=lambda kv: -kv[1][4])[:rows]:
                print(f"  {host:8.3f} s {calls:7d} calls  {key}")


def self_gpu_time(event) -> float:
    """A profiler event's own time on the GPU, in microseconds (renamed in torch 2.4)."""
    if hasattr(event, "self_device_time_total"):
        return event.self_device_time_total
    return event.self_cuda_time_total


if __name__ == "__main__":
    main()
