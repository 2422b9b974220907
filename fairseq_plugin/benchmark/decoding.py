"""Decoding in this process with fairseq's SequenceGenerator, every hypothesis forced to the same
length: beam 5 of the contestants alternated (warm: no start-up, no first shapes), and
annotated_transformer's incremental cache against recomputing the prefix."""

import contextlib
import statistics
import time

from .common import THEIRS, alternated


def decoding_model(checkpoint, data_bin, device, attention_weights=True):
    """The checkpoint's model on the device, in its precision, set up as fairseq-generate sets it
    up, and its task. ``attention_weights=False`` (annotated_transformer): no source attention
    returned, so the fused kernel runs in every attention."""
    import torch
    from fairseq import checkpoint_utils

    models, _, task = checkpoint_utils.load_model_ensemble_and_task(
        [checkpoint], arg_overrides={"data": data_bin})
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    model = models[0].eval().to(device=device.kind, dtype=dtype[device.precision])
    model.make_generation_fast_()
    model.decoder.need_attn = attention_weights
    return model, task


def forced_length_generator(model, task, beam, length):
    """fairseq's SequenceGenerator with every hypothesis forced to ``length`` tokens."""
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


def decode(model, gen, sample, device, around=None):
    """One decoding, on a GPU until its kernels have run; ``around``: a context manager factory
    put around each of the model's per-step calls (testing/operations.py)."""
    import torch

    from fairseq_plugin.testing.operations import around_step_calls

    with torch.no_grad(), (around_step_calls(model, around) if around
                           else contextlib.nullcontext()):
        gen.generate([model], sample)
    if device.kind == "cuda":
        torch.cuda.synchronize()


def print_decoding_in_process(checkpoints, data_bin, length, device, n_sentences=100, rounds=3):
    """Beam 5 of the same sources by each checkpoint ({name: path}) in this process, alternated
    over ``rounds`` after a warm-up round: medians of the seconds per decoding and of those in
    the model's per-step calls (decoder step, reorders; the rest is the encoder's and
    SequenceGenerator's), and each against fairseq's transformer."""
    setups = {}
    for name, checkpoint in checkpoints.items():
        model, task = decoding_model(checkpoint, data_bin, device)
        setups[name] = (model, forced_length_generator(model, task, 5, length),
                        random_sources(task.source_dictionary, n_sentences, device))
    spent = {name: ([], []) for name in setups}  # (whole decoding, in the model's calls)
    for r in range(1 + rounds):
        for name in alternated(list(setups), r):
            in_model = []

            @contextlib.contextmanager
            def timed(_):
                start = time.perf_counter()
                yield
                in_model.append(time.perf_counter() - start)

            start = time.perf_counter()
            decode(*setups[name], device, timed)
            if r:
                spent[name][0].append(time.perf_counter() - start)
                spent[name][1].append(sum(in_model))
    spent = {name: (statistics.median(w), statistics.median(m)) for name, (w, m) in spent.items()}
    print(f"\n| beam 5 in this process, {n_sentences} sentences x {length} tokens, "
          f"{device.kind}, medians of {rounds} alternated | decoding, s | in the model's "
          "per-step calls, s | the rest (encoder, SequenceGenerator), s |\n|---|---|---|---|")
    for name, (whole, in_model) in spent.items():
        print(f"| {name} | {whole:.3f} | {in_model:.3f} | {whole - in_model:.3f} |")
    for name in spent:
        if name != THEIRS:
            print(f"{THEIRS} / {name}: {spent[THEIRS][0] / spent[name][0]:.2f}x in decoding, "
                  f"{spent[THEIRS][1] / spent[name][1]:.2f}x in the model's calls")


def print_cache_table(checkpoint, data_bin, lengths, device, n_sentences=20, repeats=5):
    """annotated_transformer's greedy and beam-5 decoding at each target length: seconds with the
    cache (the fused kernel, the model's choice), with the cache and attention written out, and
    recomputing the whole prefix at every step (the seeds' way; testing/recomputing.py), in
    alternated rounds (fewer once a round takes over 20 s), medians."""
    from fairseq_plugin.modules.attention import EXPLICIT
    from fairseq_plugin.testing.recomputing import without_cache

    model, task = decoding_model(checkpoint, data_bin, device, attention_weights=False)
    sample = random_sources(task.source_dictionary, n_sentences, device)
    decoders = [("cached", model, None), ("written out", model, EXPLICIT),
                ("recomputed", without_cache(model), None)]

    def run(m, kernel, beam, length):
        model.force_attention_kernel(kernel)
        start = time.perf_counter()
        decode(m, forced_length_generator(m, task, beam, length), sample, device)
        return time.perf_counter() - start

    for _, m, kernel in decoders:  # warm-up: first-call costs (allocations, library set-up)
        run(m, kernel, 5, 4)
    print(f"\n| annotated_transformer decoding {n_sentences} sentences | target tokens | "
          "cached, s | cached, written-out attention, s | recomputing the prefix, s | "
          "speed-up |\n|---|---|---|---|---|---|")
    for beam in (1, 5):
        for length in lengths:
            times = {name: [] for name, _, _ in decoders}
            for r in range(repeats):
                start_round = time.perf_counter()
                for name, m, kernel in alternated(decoders, r):
                    times[name].append(run(m, kernel, beam, length))
                if time.perf_counter() - start_round > 20.0:
                    break
            cached, other, recomputed = (statistics.median(t) for t in times.values())
            print(f"| {'greedy' if beam == 1 else f'beam {beam}'} | {length} | {cached:.3f} | "
                  f"{other:.3f} | {recomputed:.3f} | {recomputed / cached:.1f}x |")
