"""The benchmark's tables: each contestant against fairseq's transformer, as the median of the
per-round ratios; and each training run's model FLOPs utilisation (MFU): its achieved FLOP/s,
6 · (N_enc · S/T + N_dec + d_model · V) per target token (Kaplan et al. 2020: 2 FLOPs per
parameter and token forward, 4 backward; docs/benchmarks.md says what it leaves out) times its
target words/s, over the device's peak."""

import os
import statistics
import time

from .common import OURS, THEIRS, fairseq_setup, training_flags

# dense peaks in TFLOP/s (datasheets); fp32 as torch runs it by default (TF32 off)
GPU_PEAKS = [  # (what the device name contains, {precision: TFLOP/s})
    ("H200", {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9}),
    ("H100 PCIe", {"bf16": 756.0, "fp16": 756.0, "fp32": 51.2}),
    ("H100", {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9}),  # SXM
    ("A100", {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5}),
]


def layer_parameters(model):
    """(N_enc, N_dec, d_model · V): the parameters of the encoder's and the decoder's layers (of
    their sublayers: fairseq 0.12.2's encoder layer also holds zero-filled copies of its weights
    for its BetterTransformer path, which do no training work) and the output projection's."""
    def count(layers):
        return sum(p.numel() for layer in layers for sublayer in layer.children()
                   for p in sublayer.parameters())
    decoder = model.decoder
    projection = getattr(decoder, "output_projection", None) or decoder.generator.proj
    return count(model.encoder.layers), count(decoder.layers), projection.weight.numel()


def source_per_target(data_bin: str, split: str = "train") -> float:
    """S/T: source tokens per target token in ``split`` of a data-bin (EOS included on both
    sides, as fairseq counts its target words)."""
    from fairseq.data import data_utils, indexed_dataset

    src, tgt = data_utils.infer_language_pair(data_bin)
    totals = []
    for lang in (src, tgt):
        path = os.path.join(data_bin, f"{split}.{src}-{tgt}.{lang}")
        dataset = indexed_dataset.make_dataset(path, impl=indexed_dataset.infer_dataset_impl(path))
        totals.append(float(dataset.sizes.sum()))
    return totals[0] / totals[1]


def measured_cpu_peak(precision="fp32", size=1024, seconds=1.0, at_least=10) -> float:
    """The CPU's rate of large matrix products in FLOP/s with torch's threads: the fastest of
    the products made over ``seconds`` (at least ``at_least``), so that a slow spell of a shared
    machine does not set it (ten in a row once read 0.09 TFLOP/s where training ran at 0.11)."""
    import torch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    a @ b  # warm-up
    best, products, began = float("inf"), 0, time.perf_counter()
    while products < at_least or time.perf_counter() - began < seconds:
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
        products += 1
    return 2.0 * size ** 3 / best


def device_peak(device, given_tflops=None, gpu_name=None):
    """(the peak in FLOP/s, where it comes from): --peak-tflops where given, else the GPU table
    (None for a GPU it does not know) or the CPU's measured rate."""
    import torch

    if given_tflops:
        return given_tflops * 1e12, "given by --peak-tflops"
    if device.kind == "cpu":
        return (measured_cpu_peak(device.precision), f"the CPU's measured {device.precision} "
                f"matrix-product rate, {torch.get_num_threads()} threads")
    name = gpu_name or torch.cuda.get_device_name()
    for part, peaks in GPU_PEAKS:
        if part in name:
            return peaks[device.precision] * 1e12, f"{name}'s dense {device.precision} peak"
    return None, f"no peak known for {name}: give --peak-tflops for MFU"


def mfu_line(flops_per_token: float, words_per_second: float, peak) -> str:
    """'X TFLOP/s, Y % MFU' (without the second part where the peak is unknown)."""
    achieved = flops_per_token * words_per_second
    return f"{achieved / 1e12:.4g} TFLOP/s" + (f", {achieved / peak:.2%} MFU" if peak else "")


def ratio_row(label, name, ours, theirs):
    """A table row: the medians, the median of the per-round ratios and the ratios."""
    ratios = [a / b for a, b in zip(ours, theirs)]
    return (f"| {label} | {name} | {statistics.median(ours):.0f} | {statistics.median(theirs):.0f}"
            f" | {statistics.median(ratios):.2f}x | {' '.join(f'{x:.2f}' for x in ratios)} |")


def step_ratio_line(name, ours, theirs):
    """fairseq's time over ``name``'s for the same steps: in all, and the median per step."""
    return (f"{THEIRS} / {name}: {sum(theirs) / sum(ours):.3f}x in all ({sum(theirs):.3f} s / "
            f"{sum(ours):.3f} s), median of the per-step ratios "
            f"{statistics.median(b / a for a, b in zip(ours, theirs)):.3f}x")


# the table's rows: (the figure's key, its label)
ROWS = [("train_wps", "training, target words/s"),
        ("later_wps", "training after the first epoch, target words/s"),
        ("gen_tps", "generation beam 5, tokens/s"),
        ("train_mb", "training peak memory, MB"),
        ("gen_mb", "generation peak memory, MB")]


def print_ratio_table(results, ct2, complete, flops):
    """Each contestant against fairseq's transformer: the ratio of each round's runs, then their
    median (the machine's speed drifts between rounds more than between the runs of a round);
    then each one's MFU, the median of its rounds. ``results``: {name: {key of ROWS: [one figure
    per round]}}; ``ct2``: CTranslate2's gen_tps and gen_mb (empty where not measured);
    ``flops``: model_flops's."""
    theirs = results[THEIRS]
    print(f"\n| medians of {complete} rounds | model | the model | transformer | "
          "median of the per-round ratios | per-round ratios |\n|---|---|---|---|---|---|")
    later = all(None not in res["later_wps"] for res in results.values())
    for key, label in ROWS:
        if (key == "later_wps" and not later) or not theirs[key]:
            continue  # (said under the table; or not measured: --skip-generation)
        for name in results:
            if name != THEIRS:
                print(ratio_row(label, name, results[name][key], theirs[key]))
    if ct2["gen_tps"]:
        print(ratio_row("generation beam 5, tokens/s", "annotated_transformer exported to "
                        "CTranslate2", ct2["gen_tps"], theirs["gen_tps"]))
    if not later:
        print("\n(no row for training after the first epoch: not every training command logged "
              "an interval after its first epoch; raise --train-updates for it)")
    if flops["peak"]:
        def share(name, key):
            return statistics.median(flops[name] * words / flops["peak"]
                                     for words in results[name][key])
        print("\nmodel FLOPs utilisation in training, medians of the rounds: " + "; ".join(
            f"{name} {share(name, 'train_wps'):.2%}"
            + (f" ({share(name, 'later_wps'):.2%} after the first epoch)" if later else "")
            for name in results))


def model_flops(data_bin, contestants, preset, max_tokens, device, peak_tflops=None):
    """{"peak": FLOP/s or None, name: model FLOPs per target token} for every contestant, each
    from its own model's sizes (built once per --arch), printed with the device's peak."""
    ratio = source_per_target(data_bin)
    flops, by_arch = {"peak": None}, {}
    for c in contestants:
        if c.arch not in by_arch:  # the model built, not trained: for its sizes
            cfg, task = fairseq_setup(training_flags(data_bin, c, preset, max_tokens, device))
            n_enc, n_dec, output = layer_parameters(task.build_model(cfg.model))
            by_arch[c.arch] = 6.0 * (n_enc * ratio + n_dec + output)
            print(f"{c.arch}: {by_arch[c.arch] / 1e9:.4g} GFLOP per target token = 6 x "
                  f"({n_enc:,} encoder layer parameters x {ratio:.2f} source tokens per target "
                  f"token + {n_dec:,} decoder layer parameters + {output:,} of the output "
                  "projection)")
        flops[c.name] = by_arch[c.arch]
    flops["peak"], source = device_peak(device, peak_tflops)
    print("peak: " + (f"{flops['peak'] / 1e12:.4g} TFLOP/s, " if flops["peak"] else "")
          + source, flush=True)
    return flops


def print_step_times(seconds, tokens, flops):
    """--steps-in-process's lines: each contestant's median step and its ratio to fairseq's, and
    its FLOP/s over the timed steps. Returns {name: (target words/s over the timed steps, median
    of the per-step ratios fairseq's step / this one's)}."""
    ours, theirs = seconds[OURS], seconds[THEIRS]
    print(f"\n{len(ours)} training steps each, alternated: {OURS} median "
          f"{1000 * statistics.median(ours):.0f} ms, {THEIRS} median "
          f"{1000 * statistics.median(theirs):.0f} ms")
    print(step_ratio_line(OURS, ours, theirs))
    for name in seconds:
        if name not in (OURS, THEIRS):
            print(f"{name}: median {1000 * statistics.median(seconds[name]):.0f} ms; "
                  f"{step_ratio_line(name, seconds[name], theirs)}")
    for name, times in seconds.items():
        print(f"{name}: {tokens / sum(times):.0f} target words/s over the timed steps, "
              + mfu_line(flops[name], tokens / sum(times), flops["peak"]), flush=True)
    return {name: (tokens / sum(times), statistics.median(b / a for a, b in zip(times, theirs)))
            for name, times in seconds.items()}


def print_sweep_table(sweep, flops, steps):
    """The --max-tokens sweep: by batch size, each contestant's target words/s over its timed
    steps (MFU where the peak is known), and each of ours' median per-step ratio against
    fairseq's transformer. ``sweep``: {max_tokens: print_step_times's dict}."""
    names = list(next(iter(sweep.values())))
    ours = [name for name in names if not name.startswith(THEIRS)]
    print(f"\n| --max-tokens ({steps} steps each, alternated) | "
          + " | ".join(f"{name} words/s" + (" (MFU)" if flops["peak"] else "") for name in names)
          + " | " + " | ".join(f"{name} / {THEIRS}" for name in ours) + " |")
    print("|---" * (1 + len(names) + len(ours)) + "|")
    for max_tokens, figures in sweep.items():
        cells = [f"{figures[name][0]:.0f}" + (f" ({flops[name] * figures[name][0] / flops['peak']:.1%})"
                                             if flops["peak"] else "") for name in names]
        cells += [f"{figures[name][1]:.2f}x" for name in ours]
        print(f"| {max_tokens} | " + " | ".join(cells) + " |")
