"""What the fused attention kernel costs at a shape it has not seen, against a shape it has.

The model's attention (``fairseq_plugin.modules.attention.attend``) is called here as the model
calls it, inside each choice of ``--fused-attention-backends`` (``fused_backends``, which the
model's stacks enter around their layers), at shapes each new to the process:

- a beam-search decoding step's self-attention, 8 sentences x beam 5, as cache.py hands it over:
  each sentence's 5 queries side by side, 5 keys more at every step, an additive ancestry mask;
- a training batch: forward and backward, a padding mask, ``--max-tokens`` worth of rows of one
  new length.

For each shape the first call is timed, then the same call again (the median of a few); the
difference is what a new shape costs. The hypothesis it tests (docs/benchmarks.md, "Caveats"): torch's cuDNN
backend builds an execution plan for each new shape of its inputs (pytorch #155958), where the
other backends do not. The operator each choice ran is named (torch.profiler), since torch picks
the backend per call.

    python scripts/attention_new_shapes.py --device cuda --precision fp16
    TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1 python scripts/attention_new_shapes.py --device cuda ...
    (torch's opt-in against the re-planning; the header says whether it is set)
"""

import argparse
import os
import statistics
import time

import torch

from fairseq_plugin.modules.attention import (FUSED, NO_CUDNN, TORCH_CHOICE, attend,
                                              fused_backends, group_queries)
from fairseq_plugin.modules.cache import MIN_CAPACITY, aligned
from fairseq_plugin.modules.dropout import Dropout

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
HEADS, D_K, SENTENCES, BEAM = 8, 64, 8, 5
NO_DROPOUT = Dropout(0.0, "attention_new_shapes", cpu_mask=False)


def attend_on(backends, *args):
    """``attend(*args)`` with the fused kernel on ``backends``, as the model's stacks run it."""
    with fused_backends(backends, args[0].device):
        return attend(*args)


def decoding_step(steps, device, dtype):
    """Beam search's self-attention at step ``steps`` as the grouped cache hands it to attention
    (cache.py): each sentence's 5 queries side by side (8, h, 5, d_k), their keys and values
    (8, h, steps * 5, d_k) read from buffers of MIN_CAPACITY steps, the additive ancestry mask
    (8, 1, 5, steps * 5) read from its (40, capacity) buffer."""
    capacity = max(MIN_CAPACITY, steps) * BEAM
    q = group_queries(torch.randn(SENTENCES * BEAM, HEADS, 1, D_K, device=device, dtype=dtype),
                      BEAM)
    k, v = (torch.randn(SENTENCES, HEADS, capacity, D_K, device=device, dtype=dtype)
            [:, :, :steps * BEAM] for _ in "kv")
    mask = torch.zeros(SENTENCES * BEAM, aligned(capacity), device=device, dtype=dtype)
    mask = mask[:, :steps * BEAM].view(SENTENCES, 1, BEAM, steps * BEAM)
    return lambda backends: attend_on(backends, q, k, v, mask, False, NO_DROPOUT, FUSED)


def training_batch(length, max_tokens, device, dtype):
    """A training batch's encoder self-attention, forward and backward, as the model projects
    it (one [W^Q; W^K; W^V] product, split into heads): (max_tokens / length) rows of
    ``length`` positions, the last row's last quarter padding."""
    rows = max(1, max_tokens // length)
    qkv = torch.randn(rows, length, 3, HEADS, D_K, device=device, dtype=dtype, requires_grad=True)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # 3 x (rows, h, length, d_k)
    mask = torch.ones(rows, 1, 1, length, dtype=torch.bool, device=device)
    mask[-1, ..., length - length // 4:] = False

    def call(backends):
        out, _, _ = attend_on(backends, q, k, v, mask, False, NO_DROPOUT, FUSED)
        out.sum().backward()
    return call


def timed(call, backends, device) -> float:
    """Seconds of one call, the GPU's work included."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    call(backends)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def attention_operator(call, backends) -> str:
    """The operator that computed the attention (the innermost under scaled_dot_product_attention)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        call(backends)
    names = [e.name for e in prof.events() if e.name.startswith("aten::_")
             and any(word in e.name for word in ("attention", "flash", "efficient"))
             and "backward" not in e.name]
    return names[-1] if names else "aten::scaled_dot_product_attention (math: plain operators)"


def measure(make, lengths, backends_order, device, again=3):
    """{backends: ([first-call s], [again s], [lengths])}, each length new to the process and
    used by one choice only; the choices take turns, in the order A B, B A, A B, ..."""
    times = {b: ([], [], []) for b in backends_order}
    k = len(backends_order)
    for i, length in enumerate(lengths):
        backends = backends_order[(i + i // k) % k]
        call = make(length)
        first, seconds, used = times[backends]
        first.append(timed(call, backends, device))
        seconds.append(statistics.median(timed(call, backends, device) for _ in range(again)))
        used.append(length)
    return times


def print_table(title, times, operators):
    print(f"\n{title}")
    print("| --fused-attention-backends | operator | first call, ms | again, ms | "
          "a new shape costs, ms | shapes |")
    print("|---|---|---|---|---|---|")
    for backends, (first, again, _) in times.items():
        f, a = statistics.median(first) * 1e3, statistics.median(again) * 1e3
        print(f"| {backends} | {operators[backends]} | {f:.3f} | {a:.3f} | {f - a:.3f} | "
              f"{len(first)} |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--precision", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--shapes", type=int, default=12, help="new shapes for each choice (default 12)")
    p.add_argument("--max-tokens", type=int, default=8192, help="a training batch's tokens")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA GPU here; run with --device cpu")
    for flag, value in (("--shapes", args.shapes), ("--max-tokens", args.max_tokens)):
        if value < 1:
            p.error(f"{flag} {value}: give a whole number of at least 1")
    device, dtype = torch.device(args.device), DTYPES[args.precision]
    choices = (TORCH_CHOICE, NO_CUDNN)
    print(f"attention at new shapes: {device}, {dtype}, torch {torch.__version__}, cuDNN "
          f"{torch.backends.cudnn.version()}, TORCH_CUDNN_SDPA_AVOID_RECOMPILE="
          f"{os.environ.get('TORCH_CUDNN_SDPA_AVOID_RECOMPILE', '(not set)')}")
    n = args.shapes * len(choices)
    # a warm-up at shapes outside the measured ones: CUDA's context, the kernels' first loads
    for backends in choices:
        timed(decoding_step(1000, device, dtype), backends, device)
        timed(training_batch(1000, args.max_tokens, device, dtype), backends, device)
    step_lengths = range(2, 2 + n)  # steps 2, 3, ...: 5 keys more each, as in beam search
    batch_lengths = range(16, 16 + n)  # padded lengths of training batches
    for title, make, lengths in (
            ("decoding steps: self-attention of 8 sentences x beam 5, steps "
             f"{step_lengths[0]}..{step_lengths[-1]} (5 keys a step, grouped as cache.py does)",
             lambda L: decoding_step(L, device, dtype), step_lengths),
            (f"training batches, forward and backward: {args.max_tokens} tokens in rows of "
             f"length {batch_lengths[0]}..{batch_lengths[-1]}, padding mask",
             lambda L: training_batch(L, args.max_tokens, device, dtype), batch_lengths)):
        times = measure(make, lengths, choices, device)
        # named at a shape each choice has seen (its last), so that none is new to it
        operators = {b: attention_operator(make(times[b][2][-1]), b) for b in choices}
        print_table(title, times, operators)


if __name__ == "__main__":
    main()
