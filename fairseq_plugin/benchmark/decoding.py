"""Decoding in this process with fairseq's SequenceGenerator, every hypothesis forced to the same
length: beam 5 of both models alternated (where its time goes), the incremental cache against
recomputing the prefix, and the operations per decoder step."""

import statistics
import time

from .common import CPU, OURS, THEIRS, alternated
from .profiling import add_profile, print_profile, profiler_activities, time_by_part


def decoding_in_process(checkpoints, data_bin, length, n_sentences=100, rounds=3, device=CPU,
                        rows=15):
    """Beam 5 of the same sources by each model in this process, as fairseq-generate runs it
    (SequenceGenerator), alternated over ``rounds``: seconds per decoding and the part spent in
    the model's per-step calls (decoder step, reorders: on a GPU, the host queuing their work and
    waiting at their reads); the rest is the encoder's and SequenceGenerator's. Then
    torch.profiler's operators of one more decoding of each. ``checkpoints``: {name:
    checkpoint}; returns {name: (seconds, seconds in the model's calls)}, medians."""
    import contextlib

    import torch
    from torch.profiler import profile, record_function

    from fairseq_plugin.testing.operations import STEP_CALLS, around_calls, around_step_calls

    setups = {}
    for name, checkpoint in checkpoints.items():
        model, task = decoding_model(checkpoint, data_bin, device)
        gen = forced_length_generator(model, task, 5, length)
        setups[name] = (model, gen, random_sources(task.source_dictionary, n_sentences, device))

    def decode(name, around):
        model, gen, sample = setups[name]
        with torch.no_grad(), around_step_calls(model, around):
            gen.generate([model], sample)
        if device.kind == "cuda":
            torch.cuda.synchronize()

    spent = {name: ([], []) for name in setups}  # (whole decoding, in the model's calls)
    for r in range(1 + rounds):  # a warm-up round first
        for name in alternated(list(setups), r):
            in_model = []

            @contextlib.contextmanager
            def timed(_):
                start = time.perf_counter()
                yield
                in_model.append(time.perf_counter() - start)
            start = time.perf_counter()
            decode(name, timed)
            if r:
                spent[name][0].append(time.perf_counter() - start)
                spent[name][1].append(sum(in_model))
    parts = {}
    for name in alternated(list(setups), rounds):
        model = setups[name][0]
        with profile(activities=profiler_activities(device), with_flops=True) as prof, \
                around_calls([(model.encoder, "forward")],
                             lambda _: record_function(f"model.{ENCODER}")):
            start = time.perf_counter()
            decode(name, lambda call: record_function(f"model.{call}"))  # rows of their own
            wall = time.perf_counter() - start
        ops = {}
        add_profile(ops, prof, device)
        calls = {call: ops.pop(f"model.{call}", [0.0] * 5)[4] for _, call in STEP_CALLS}
        ops.pop(f"model.{ENCODER}", None)
        print_profile(f"{name}, beam 5, {n_sentences} sentences x {length} tokens, profiled",
                      ops, device, rows, wall)
        print("  (CPU time in the model's calls: " + ", ".join(
            f"{call} {seconds:.3f} s" for call, seconds in calls.items()) + ")")
        parts[name] = time_by_part(
            prof, [f"model.{call}" for _, call in STEP_CALLS] + [f"model.{ENCODER}"], device)
    print_parts({name: parts[name] for name in setups},  # in the order given
                f"beam 5, {n_sentences} sentences x {length} tokens, one profiled decoding, "
                f"{'GPU' if device.kind == 'cuda' else 'CPU'} time, s")
    return {name: (statistics.median(whole), statistics.median(model))
            for name, (whole, model) in spent.items()}


ENCODER = "encoder.forward"  # the encoder's pass, once per decoding: profiled as a range too


def decoding_parts(parts):
    """A decoding's time by part, from ``time_by_part`` over the model's calls' ranges: rows of
    (label, seconds). The kinds of operator inside the model's passes (encoder, decoder steps);
    the reorders whole; outside the model, fairseq's SequenceGenerator (the log-probabilities
    included: SequenceGenerator asks for them outside the decoder's forward)."""
    from fairseq_plugin.testing.operations import STEP_CALLS

    passes = ("model.forward", f"model.{ENCODER}")  # the decoder's steps, the encoder's pass
    reorders = [f"model.{call}" for _, call in STEP_CALLS if call != "forward"]

    def total(ranges, kinds=("matrix products", "attention", "other")):
        return sum(s for (part, kind), s in parts.items() if part in ranges and kind in kinds)

    return [("matrix products of the model's passes (mm, addmm)",
             total(passes, ["matrix products"])),
            ("attention's kernels (fused; or bmm, softmax)", total(passes, ["attention"])),
            ("the rest of the model's passes", total(passes, ["other"])),
            ("reordering for beam search", total(reorders)),
            ("SequenceGenerator's own, log-probabilities included", total([None])),
            ("the profiled decoding", sum(parts.values()))]


def print_parts(parts, title):
    """One column per model of ``decoding_parts``: where each decoding's time goes."""
    names = list(parts)
    rows = {name: decoding_parts(parts[name]) for name in names}
    print(f"\n| {title} | {' | '.join(names)} |\n|---|{'---|' * len(names)}")
    for i, (label, _) in enumerate(rows[names[0]]):
        print(f"| {label} | {' | '.join(f'{rows[name][i][1]:.3f}' for name in names)} |")


def decoding_model(checkpoint, data_bin, device=CPU, attention_weights=True):
    """The checkpoint's model, on the device in its precision and set up as fairseq-generate sets
    it up, and its task. ``attention_weights=False`` (annotated_transformer only): no source
    attention returned, so the fused kernel runs in every attention."""
    import torch
    from fairseq import checkpoint_utils

    models, _, task = checkpoint_utils.load_model_ensemble_and_task(
        [checkpoint], arg_overrides={"data": data_bin})
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    model = models[0].eval().to(device=device.kind, dtype=dtype[device.precision])
    model.make_generation_fast_()
    model.decoder.need_attn = attention_weights
    return model, task


def cache_speedups(checkpoint, data_bin, lengths, n_sentences=20, repeats=5, device=CPU):
    """annotated_transformer: seconds per decoding with the cache, with the cache and attention
    written out (the model's choice, ``choose_kernel``, is the fused kernel), and without the
    cache."""
    import torch
    from fairseq_plugin.modules.attention import EXPLICIT, MultiHeadedAttention
    from fairseq_plugin.testing.recomputing import without_cache

    model, task = decoding_model(checkpoint, data_bin, device, attention_weights=False)
    recomputing = without_cache(model)
    sample = random_sources(task.source_dictionary, n_sentences, device)
    attention = [m for m in model.modules() if isinstance(m, MultiHeadedAttention)]
    rows = []
    decoders = [("cached", model, None), ("written out", model, EXPLICIT),
                ("recomputed", recomputing, None)]
    for name, m, kernel in decoders:  # warm-up: first-call costs (allocations, library set-up)
        for module in attention:
            module.kernel = kernel
        with torch.no_grad():
            forced_length_generator(m, task, 5, 4).generate([m], sample)
    for beam in (1, 5):
        for length in lengths:
            runs = {name: [] for name, _, _ in decoders}
            # rounds in alternated order, medians; fewer rounds once a round takes over 20 s
            for r in range(repeats):
                start_round = time.perf_counter()
                for name, m, kernel in alternated(decoders, r):
                    for module in attention:
                        module.kernel = kernel
                    gen = forced_length_generator(m, task, beam, length)
                    start = time.perf_counter()
                    with torch.no_grad():
                        gen.generate([m], sample)
                    if device.kind == "cuda":
                        torch.cuda.synchronize()
                    runs[name].append(time.perf_counter() - start)
                if time.perf_counter() - start_round > 20.0:
                    break
            times = {name: statistics.median(seconds) for name, seconds in runs.items()}
            rows.append((beam, length, times["cached"], times["written out"], times["recomputed"]))
    return rows


def forced_length_generator(model, task, beam, length):
    """fairseq's SequenceGenerator with every hypothesis forced to ``length`` tokens, so that
    every model does the same work (as generate_run forces fairseq-generate)."""
    from fairseq.sequence_generator import SequenceGenerator
    return SequenceGenerator([model], task.target_dictionary, beam_size=beam, min_len=length,
                             max_len_a=0, max_len_b=length)


def random_sources(d, n_sentences, device, length=24):
    """A batch of n random source sentences of ``length`` tokens (the last one EOS)."""
    import torch
    g = torch.Generator().manual_seed(0)
    src = torch.randint(d.nspecial, len(d), (n_sentences, length), generator=g)
    src[:, -1] = d.eos()
    return {"net_input": {"src_tokens": src.to(device.kind),
                          "src_lengths": torch.full((n_sentences,), length, device=device.kind)}}


def step_operations(checkpoints, data_bin, length, n_sentences=20, device=CPU):
    """Per decoder step of beam 5, as fairseq-generate runs it: the operations that launch work
    and the reads to the host (fairseq_plugin.testing.operations). ``checkpoints``: {column:
    (checkpoint, attention kernel to force or None)}; returns {column: {"launches", "reads"}}."""
    import torch
    from fairseq_plugin.modules.attention import MultiHeadedAttention
    from fairseq_plugin.testing.operations import counting_step_calls, per_step

    counts = {}
    for column, (checkpoint, kernel) in checkpoints.items():
        model, task = decoding_model(checkpoint, data_bin, device, attention_weights=False)
        for module in model.modules():
            if isinstance(module, MultiHeadedAttention):
                module.kernel = kernel
        gen = forced_length_generator(model, task, 5, length)
        sample = random_sources(task.source_dictionary, n_sentences, device)
        with torch.no_grad(), counting_step_calls(model) as calls:
            gen.generate([model], sample)
        counts[column] = per_step(calls)
    return counts


def print_cache_tables(checkpoints, data_bin, lengths, gen_length, device=CPU):
    """annotated_transformer's decoding with its cache against recomputing the prefix
    (cache_speedups), and the operations per beam-5 decoder step of both models
    (step_operations: what sets the pace of small decoding steps on a GPU). ``checkpoints``:
    {name: a first-round checkpoint}."""
    from fairseq_plugin.modules.attention import EXPLICIT

    rows = cache_speedups(checkpoints[OURS], data_bin, lengths, device=device)
    print("\n| annotated_transformer decoding 20 sentences | target tokens | cached, s | "
          "cached, written-out attention, s | recomputing the prefix, s | speed-up |")
    print("|---|---|---|---|---|---|")
    for beam, length, cached, other, recomputed in rows:
        name = "greedy" if beam == 1 else f"beam {beam}"
        print(f"| {name} | {length} | {cached:.3f} | {other:.3f} | {recomputed:.3f} | "
              f"{recomputed / cached:.1f}x |")
    columns = {OURS: (checkpoints[OURS], None),
               f"{OURS}, written-out attention": (checkpoints[OURS], EXPLICIT),
               THEIRS: (checkpoints[THEIRS], None)}
    ops = step_operations(columns, data_bin, gen_length, device=device)
    print(f"\n| per beam-5 decoder step, 20 sentences, {gen_length} tokens, "
          f"{device.kind} | {' | '.join(columns)} |\n|---|---|---|---|")
    for key, label in (("launches", "operations that launch work"),
                       ("reads", "reads back to the host")):
        print(f"| {label} | {' | '.join(f'{ops[c][key]:.1f}' for c in columns)} |")


def print_decoding_in_process(checkpoints, data_bin, gen_length, device=CPU):
    """decoding_in_process's table: beam 5 of each checkpoint ({name: checkpoint}, fairseq's
    transformer second) in this process, and each against fairseq's."""
    spent = decoding_in_process(checkpoints, data_bin, gen_length, device=device)
    print(f"\n| beam 5 in this process, 100 sentences x {gen_length} tokens, "
          f"{device.kind}, medians of 3 alternated | decoding, s | in the model's per-step "
          "calls, s | the rest (encoder, SequenceGenerator), s |\n|---|---|---|---|")
    for name, (whole, in_model) in spent.items():
        print(f"| {name} | {whole:.3f} | {in_model:.3f} | {whole - in_model:.3f} |")
    for name in spent:
        if name != THEIRS:
            print(f"{THEIRS} / {name}: {spent[THEIRS][0] / spent[name][0]:.2f}x in decoding, "
                  f"{spent[THEIRS][1] / spent[name][1]:.2f}x in the model's calls")
