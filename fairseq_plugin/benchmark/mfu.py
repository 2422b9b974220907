"""Model FLOPs utilisation (MFU): how much of the device's arithmetic a training run uses.

A training step costs about 6 FLOPs per parameter for each token the parameter acts on (2 in
the forward pass, 4 in the backward: Kaplan et al. 2020, "Scaling laws for neural language
models"). The encoder's layers act on every source token, the decoder's layers and the output
projection on every target token, so per target token

    6 · (N_enc · S/T + N_dec + d_model · V)

N_enc, N_dec: the parameters of the encoder's and the decoder's layers (the model's own, counted);
S/T: source tokens per target token in the training data (real tokens, no padding); V: the
target vocabulary. The output projection counts even when its weights are the embeddings'.
Left out: attention's scores and weighted sums (about 12 · layers · length · d_model per token:
a few per cent at these sentence lengths) and the element-wise work; padding counts for
nothing. Achieved FLOP/s = that × fairseq's target words/s; MFU = achieved / the device's peak.
The peak: a table of dense tensor-core peaks by GPU name and precision (datasheets), or on the
CPU the rate of large matrix products measured in this process.
"""

import os
import time

# dense (no sparsity) peaks in TFLOP/s by precision; fp32 as torch runs it by default (TF32 off
# for matrix products: the CUDA cores' rate)
GPU_PEAKS = [  # (what the device name contains, {precision: TFLOP/s})
    ("H200", {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9}),
    ("H100 PCIe", {"bf16": 756.0, "fp16": 756.0, "fp32": 51.2}),
    ("H100", {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9}),  # SXM
    ("A100", {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5}),
]


def layer_parameters(model):
    """(N_enc, N_dec, d_model · V): the parameters of the encoder's and the decoder's layers and
    the size of the output projection, of annotated_transformer or fairseq's transformer (their
    stacks keep their layers in ``.layers``)."""
    def count(layers):
        # the parameters of each layer's sublayers; fairseq 0.12.2's encoder layer also holds
        # zero-filled copies of its weights as its own parameters, for its BetterTransformer
        # inference path, which do no training work
        return sum(p.numel() for layer in layers for sublayer in layer.children()
                   for p in sublayer.parameters())
    decoder = model.decoder
    # the output projection, (V, d_model): fairseq's transformer's, or our Generator's
    projection = getattr(decoder, "output_projection", None) or decoder.generator.proj
    return count(model.encoder.layers), count(decoder.layers), projection.weight.numel()


def flops_per_target_token(model, source_per_target: float) -> float:
    """6 · (N_enc · S/T + N_dec + d_model · V), as the module's docstring says."""
    n_enc, n_dec, output = layer_parameters(model)
    return 6.0 * (n_enc * source_per_target + n_dec + output)


def source_per_target(data_bin: str, split: str = "train") -> float:
    """Source tokens per target token in ``split`` of a data-bin (EOS included on both sides, as
    fairseq counts its target words)."""
    from fairseq.data import data_utils, indexed_dataset

    src, tgt = data_utils.infer_language_pair(data_bin)
    totals = []
    for lang in (src, tgt):
        path = os.path.join(data_bin, f"{split}.{src}-{tgt}.{lang}")
        dataset = indexed_dataset.make_dataset(path, impl=indexed_dataset.infer_dataset_impl(path))
        totals.append(float(dataset.sizes.sum()))
    return totals[0] / totals[1]


def built_model(flags):
    """The model fairseq-train's ``flags`` describe, built in this process (not trained: for its
    sizes)."""
    from .common import fairseq_setup

    cfg, task = fairseq_setup(flags)
    return task.build_model(cfg.model)


def gpu_peak(name: str, precision: str):
    """The datasheet's dense peak in FLOP/s of the GPU called ``name`` in ``precision``, or None
    where the table has no row for it."""
    for part, peaks in GPU_PEAKS:
        if part in name:
            return peaks[precision] * 1e12
    return None


def measured_cpu_peak(precision: str = "fp32", size: int = 1024, seconds: float = 1.0,
                      at_least: int = 10) -> float:
    """The CPU's rate of large matrix products in FLOP/s, in this process with torch's threads:
    the fastest of the products of two size x size matrices made over ``seconds`` (at least
    ``at_least`` of them), so that a short slow spell of a shared machine does not set the peak
    (ten products in a row once read 0.09 TFLOP/s where training then ran at 0.11)."""
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


def device_peak(device, given_tflops=None):
    """(the peak in FLOP/s, where it comes from) for ``device`` (common.Device): ``given_tflops``
    (--peak-tflops) where given, else the GPU table or the CPU's measured rate; (None, why) for
    a GPU the table does not know."""
    if given_tflops:
        return given_tflops * 1e12, "given by --peak-tflops"
    if device.kind == "cpu":
        threads = __import__("torch").get_num_threads()
        return (measured_cpu_peak(device.precision),
                f"the CPU's measured {device.precision} matrix-product rate, {threads} threads")
    import torch

    name = torch.cuda.get_device_name()
    peak = gpu_peak(name, device.precision)
    if peak is None:
        return None, f"no peak known for {name}: give --peak-tflops for MFU"
    return peak, f"{name}'s dense {device.precision} peak (datasheet)"


def utilisation(flops_per_token: float, words_per_second: float, peak) -> str:
    """'X TFLOP/s, Y % of peak' (without the second part where the peak is unknown)."""
    achieved = flops_per_token * words_per_second
    return f"{achieved / 1e12:.4g} TFLOP/s" + (f", {achieved / peak:.2%} MFU" if peak else "")
