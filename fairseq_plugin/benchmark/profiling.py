"""torch.profiler's operators of training steps or decodings: self time (the GPU's on a GPU),
calls, and the matrix products' time and FLOPs; a decoding's time by part (``time_by_part``)."""

from .common import CPU, alternated

MATRIX_PRODUCTS = ("aten::mm", "aten::addmm")
# attention's own operators: torch's fused kernels (every backend's name says so), or the
# formula written out with batched products and a softmax (fairseq's transformer, decoding)
ATTENTION = ("scaled_dot_product", "aten::bmm", "aten::baddbmm", "aten::_softmax")


def print_profiles(trainers, samples, device=CPU, rows=25):
    """torch.profiler on training steps of each trainer, alternated step by step as above: the
    operators with the most time (self time, summed over the steps: the CPU's, or on a GPU the
    GPU's) and the time and FLOPs of the matrix products (aten::mm, aten::addmm); on a GPU, the
    share of the steps' wall time the GPU was busy (a small share: the host sets the pace)."""
    from torch.profiler import profile

    from .steps import timed_step

    totals = {name: {} for name in trainers}
    walls = {name: 0.0 for name in trainers}
    for i, sample in enumerate(samples):
        for name in alternated(list(trainers), i):
            with profile(activities=profiler_activities(device), with_flops=True) as prof:
                walls[name] += timed_step(trainers[name], sample, device)
            add_profile(totals[name], prof, device)
    for name, ops in totals.items():
        print_profile(f"{name}, {len(samples)} steps profiled", ops, device, rows, walls[name])


def profiler_activities(device):
    from torch.profiler import ProfilerActivity
    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.kind == "cuda" else [])


def add_profile(ops, prof, device=CPU):
    """Add a profile's operators to ``ops``: {operator: [self seconds (the GPU's on a GPU, else
    the CPU's), calls, FLOPs, self CPU seconds, CPU seconds with what it calls]}."""
    from torch.autograd import DeviceType

    on_gpu = device.kind == "cuda"
    for e in prof.key_averages():
        if on_gpu and e.device_type != DeviceType.CPU:
            continue  # a kernel: its GPU time is already the launching operator's
        kept = ops.setdefault(e.key, [0.0, 0, 0, 0.0, 0.0])
        kept[0] += (self_gpu_time(e) if on_gpu else e.self_cpu_time_total) / 1e6
        kept[1] += e.count
        kept[2] += e.flops or 0
        kept[3] += e.self_cpu_time_total / 1e6
        kept[4] += e.cpu_time_total / 1e6


def print_profile(title, ops, device=CPU, rows=25, wall=None):
    """The operators of ``add_profile`` with the most self time, and the matrix products; with
    ``wall``, the profiled work's wall time (seconds) and, on a GPU, the share of it the GPU
    was busy."""
    on_gpu = device.kind == "cuda"
    gemm = [ops.get(key, [0.0] * 5) for key in MATRIX_PRODUCTS]
    busy = sum(t[0] for t in ops.values())
    print(f"\n{title}: {busy:.2f} s of {'GPU' if on_gpu else 'CPU'} "
          "time" + (f" ({sum(t[3] for t in ops.values()):.2f} s of CPU time)" if on_gpu else "")
          + ("" if wall is None else f" in {wall:.2f} s of wall time"
             + (f" (the GPU busy {busy / wall:.0%} of it)" if on_gpu else ""))
          + f", matrix products {sum(t[0] for t in gemm):.2f} s, "
          f"{sum(t[2] for t in gemm) / 1e9:,.1f} GFLOP")
    for key, (seconds, calls, *_) in sorted(ops.items(), key=lambda kv: -kv[1][0])[:rows]:
        print(f"  {seconds:8.3f} s {calls:7d} calls  {key}")
    if on_gpu:  # small steps wait on the host: where its time goes (nested operators overlap)
        print("  by the CPU's time, with what each calls:")
        for key, (_, calls, _, _, host) in sorted(ops.items(), key=lambda kv: -kv[1][4])[:rows]:
            print(f"  {host:8.3f} s {calls:7d} calls  {key}")


def self_gpu_time(event) -> float:
    """A profiler event's own time on the GPU, in microseconds (renamed in torch 2.4)."""
    if hasattr(event, "self_device_time_total"):
        return event.self_device_time_total
    return event.self_cuda_time_total


def operator_kind(name: str) -> str:
    """"matrix products", "attention" or "other" for an operator's name."""
    if name in MATRIX_PRODUCTS:
        return "matrix products"
    return "attention" if any(a in name for a in ATTENTION) else "other"


def time_by_part(prof, ranges, device=CPU):
    """Seconds of self time (the GPU's on a GPU) of a profile's operators, by the innermost of
    the named ``ranges`` (record_function labels) each ran in, or None outside them all, and by
    ``operator_kind``: {(range or None, kind): seconds}. Each operator counts once (self time),
    so the parts add up to the profile's total."""
    from torch.autograd import DeviceType

    on_gpu = device.kind == "cuda"
    parts = {}
    for e in prof.events():
        if e.device_type != DeviceType.CPU or not e.name.startswith("aten::"):
            continue  # kernels (their GPU time is their operator's), and the ranges themselves
        part = e.cpu_parent
        while part is not None and part.name not in ranges:
            part = part.cpu_parent
        key = (part.name if part is not None else None, operator_kind(e.name))
        seconds = (self_gpu_time(e) if on_gpu else e.self_cpu_time_total) / 1e6
        parts[key] = parts.get(key, 0.0) + seconds
    return parts
