"""annotated-benchmark: speed and memory of annotated_transformer against fairseq's transformer,
side by side, with identical hyper-parameters, data and batches; rounds alternate the order
(A B, B A, ...) and the tables give medians and the median of the per-round ratios.

What each figure is and how it is measured: docs/benchmarks.md ("Method"). Absolute numbers move
+-10% between runs on shared machines: read the ratios.
"""

import argparse
import gc
import os
import shutil
import signal
import tempfile
import time

from fairseq_plugin import fairseq_changes

from .child import ABORTED_AFTER_FINISHING, Device
from .common import (CONTESTANTS, OURS, PRESETS, THEIRS, Stopped, alternated, contestants, folder_name,
                     raise_stopped)
from .data import batch_padding, first_test_sentences, make_data, prepare_tatoeba
from .decoding import print_cache_table, print_decoding_in_process
from .report import (ROWS, mfu_line, model_flops, print_ratio_table, print_step_times,
                     print_sweep_table)
from .runs import ctranslate2_run, generate_run, train_run
from .steps import steps_in_process


def whole_numbers(text: str):
    """An argparse type: whole numbers of at least 1, separated by commas."""
    try:
        numbers = [int(x) for x in text.split(",")]
    except ValueError:
        numbers = [0]
    if min(numbers) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give whole numbers of at least 1, separated "
                                         "by commas, e.g. 25,50,100")
    return numbers


def positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    numbers = whole_numbers(text)
    if len(numbers) > 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give one whole number of at least 1")
    return numbers[0]


def parser():
    p = argparse.ArgumentParser(prog="annotated-benchmark", description=__doc__)
    add = p.add_argument
    add("--contestants", type=contestants, default="annotated_transformer,transformer",
        help="the models in every round, comma-separated: annotated_transformer and transformer, "
             "and any of torch-choice (ours with --fused-attention-backends torch), "
             "without-packing (ours with --no-packing), compiled (ours with --compile-layers), "
             "before=PLUGIN_DIR (another checkout's fairseq_plugin: before/after in one run)")
    add("--preset", choices=sorted(PRESETS), default="default")
    add("--rounds", type=positive_int, default=4,
        help="rounds, the order reversed in every other one")
    add("--data", choices=["tatoeba", "synthetic"], default="tatoeba",
        help="the bundled Tatoeba sample, or generated text")
    add("--data-bin", help="a prepared data-bin instead")
    add("--train-sentences", type=positive_int, default=20000)
    add("--test-sentences", type=positive_int, default=200,
        help="generated test sentences, or how many of a test set to decode (its first N)")
    add("--vocab", type=positive_int, default=6000)
    add("--train-updates", type=positive_int, default=25)
    add("--max-tokens", type=whole_numbers, default="4096",
        help="tokens per batch; with --steps-in-process several (8192,16384,...): a sweep")
    add("--gen-length", type=positive_int, default=30, help="target tokens per hypothesis")
    add("--cache-lengths", type=whole_numbers, default="25,50,100,200")
    add("--work-dir", help="keep data and checkpoints here (default: a temp dir)")
    add("--skip-cache", action="store_true", help="no cache table")
    add("--skip-generation", action="store_true",
        help="training only: no fairseq-generate, CTranslate2 or cache table")
    add("--skip-ctranslate2", action="store_true", help="no CTranslate2 row")
    add("--device", choices=["cpu", "cuda"], default="cpu")
    add("--precision", choices=["fp32", "fp16", "bf16"],
        help="default: fp32 on cpu, fp16 on cuda")
    add("--steps-in-process", type=positive_int, metavar="N",
        help="training only: the contestants' fairseq Trainers in this process on the same N "
             "batches, alternated step by step; what a step keeps and holds")
    add("--warm-up-epoch", action="store_true",
        help="with --steps-in-process: first a whole epoch's batches each, untimed")
    add("--decoding-in-process", action="store_true",
        help="beam 5 of the first round's checkpoints in this process, alternated, warm")
    add("--peak-tflops", type=float, metavar="TFLOPS",
        help="the device's peak for MFU (default: a table of GPUs, or the CPU's measured rate)")
    return p


def refusal(args, cuda_available):
    """The first thing wrong with the options, in one error line, or None."""
    steps, work, data, cuda = (args.steps_in_process, args.work_dir, args.data_bin,
                               args.device == "cuda")
    checks = [
        (args.warm_up_epoch and not steps, "--warm-up-epoch goes with --steps-in-process N"),
        (len(args.max_tokens) > 1 and not steps,
         f"--max-tokens {','.join(map(str, args.max_tokens))}: several sizes (a sweep) go with "
         "--steps-in-process N; give one size for the rounds"),
        (steps and any(c.name.endswith("@before") for c in args.contestants),
         "--steps-in-process: before=PLUGIN_DIR runs in fairseq's commands only (two plugins "
         "cannot register in one process)"),
        (args.skip_generation and args.decoding_in_process,
         "--skip-generation --decoding-in-process: the second decodes; leave out one"),
        (cuda and not cuda_available,
         "--device cuda: torch sees no CUDA GPU here (torch.cuda.is_available() is False)"),
        (cuda and not (args.skip_ctranslate2 or args.skip_generation or steps),
         "the CTranslate2 comparison runs on the CPU only: add --skip-ctranslate2"),
        (work and os.path.exists(work) and not os.path.isdir(work),
         f"--work-dir {work} is a file; give a new or empty directory"),
        (work and os.path.isdir(work) and os.listdir(work),
         f"--work-dir {work} is not empty (fairseq-train would resume its checkpoints); give a "
         "new or empty directory, and --data-bin DIR to reuse prepared data"),
        (data and not os.path.isdir(data), f"--data-bin {data}: no such folder; give one made "
         "by fairseq-preprocess or annotated-prepare"),
        (data and os.path.isdir(data) and not any(f.startswith("test.") for f in os.listdir(data)),
         f"--data-bin {data} has no test split (test.*) to decode; binarise one with --testpref"),
    ]
    return next((message for wrong, message in checks if wrong), None)


def main(argv=None):
    p = parser()
    args = p.parse_args(argv)
    import torch

    wrong = refusal(args, torch.cuda.is_available())
    if wrong:
        p.error(wrong)
    if args.skip_generation:  # (no checkpoint is decoded)
        args.skip_ctranslate2 = args.skip_cache = True
    device = Device(args.device, args.precision or ("fp32" if args.device == "cpu" else "fp16"))
    if device.precision == "bf16":  # (in-process steps parse fairseq-train's flags here)
        fairseq_changes.install([change.name for change in fairseq_changes.BENCHMARK_BF16])
    work = args.work_dir or tempfile.mkdtemp(prefix="benchmark-")
    os.makedirs(work, exist_ok=True)
    try:
        run(args, device, work)
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)


def run(args, device, work):
    """The measurements main asked for, their data and checkpoints under ``work``."""
    if args.data_bin:
        data_bin = args.data_bin
    elif args.data == "tatoeba":
        data_bin = prepare_tatoeba(work)
    else:
        data_bin = make_data(work, args.train_sentences, args.test_sentences, args.vocab)
    src_pad, tgt_pad, n_test = batch_padding(data_bin, args.max_tokens[0])
    n_decoded = min(n_test, args.test_sentences)
    gen_bin = (data_bin if n_decoded == n_test or args.skip_generation
               else first_test_sentences(data_bin, n_decoded, work))
    print(f"benchmark: preset {args.preset} {PRESETS[args.preset]} (layers, d_model, d_ff, "
          f"heads), {args.rounds} rounds, {device.kind} {device.precision}, data {data_bin}, "
          f"torch threads {os.environ.get('OMP_NUM_THREADS', 'default')}\n"
          f"training batches: {src_pad:.1%} source and {tgt_pad:.1%} target positions are "
          f"padding; " + ("training only (--skip-generation)" if args.skip_generation else
                          f"decoding the first {n_decoded} of {n_test} test sentences"),
          flush=True)
    flops = model_flops(data_bin, args.contestants, args.preset, args.max_tokens[0], device,
                        args.peak_tflops)
    if args.steps_in_process:
        sweep = {}
        for max_tokens in args.max_tokens:
            if len(args.max_tokens) > 1:
                src_pad, tgt_pad, _ = batch_padding(data_bin, max_tokens)
                print(f"\n--max-tokens {max_tokens}: {src_pad:.1%} source and {tgt_pad:.1%} "
                      f"target positions are padding", flush=True)
            seconds, tokens = steps_in_process(
                data_bin, args.contestants, args.preset, max_tokens, args.steps_in_process,
                device, args.warm_up_epoch)
            sweep[max_tokens] = print_step_times(seconds, tokens, flops)
            gc.collect()  # the size's trainers gone, and on a GPU their cached blocks: each
            if device.kind == "cuda":  # size's peak is its own
                __import__("torch").cuda.empty_cache()
        if len(args.max_tokens) > 1:
            print_sweep_table(sweep, flops, args.steps_in_process)
        return
    results, ct2, complete = rounds(args, device, work, data_bin, gen_bin, n_decoded, flops)
    print_ratio_table(results, ct2, complete, flops)
    if ABORTED_AFTER_FINISHING:
        print(f"\n{len(ABORTED_AFTER_FINISHING)} commands finished and then aborted in Python's "
              f"shutdown, their figures kept (notes above): {', '.join(ABORTED_AFTER_FINISHING)}")
    if complete < args.rounds:
        raise SystemExit(f"benchmark: stopped after {complete} of {args.rounds} rounds (SIGTERM); "
                         "the table above gives those")
    first_round = {name: os.path.join(work, f"{folder_name(name)}-round0", "checkpoint_last.pt")
                   for name in results}
    if not args.skip_cache:
        print_cache_table(first_round[OURS], data_bin, args.cache_lengths, device)
    if args.decoding_in_process:
        # (packing and compiling change training only: their decoding is ours)
        decoded = (OURS, THEIRS, CONTESTANTS["torch-choice"].name)
        print_decoding_in_process({name: first_round[name] for name in decoded
                                   if name in first_round}, data_bin, args.gen_length, device)


def rounds(args, device, work, data_bin, gen_bin, n_decoded, flops):
    """The rounds of fairseq-train and fairseq-generate, the order alternated: returns
    ({name: {figure: [one per round]}}, CTranslate2's {figure: [...]}, the rounds complete)."""
    results = {c.name: {key: [] for key, _ in ROWS} for c in args.contestants}
    ct2 = {"gen_tps": [], "gen_mb": []}
    complete = 0
    signal.signal(signal.SIGTERM, raise_stopped)
    try:
        for r in range(args.rounds):
            for c in alternated(args.contestants, r):
                save = os.path.join(work, f"{folder_name(c.name)}-round{r}")
                started = time.perf_counter()
                wps, later_wps, mb, peak_where = train_run(
                    data_bin, c, args.preset, save, args.train_updates, args.max_tokens[0],
                    device)
                trained = time.perf_counter()
                for key, figure in (("train_wps", wps), ("later_wps", later_wps),
                                    ("train_mb", mb)):
                    results[c.name][key].append(figure)
                generated = ""
                if not args.skip_generation:
                    tps, gen_mb = generate_run(gen_bin, os.path.join(save, "checkpoint_last.pt"),
                                               args.gen_length, args.max_tokens[0], c.user_dir,
                                               n_decoded, device)
                    results[c.name]["gen_tps"].append(tps)
                    results[c.name]["gen_mb"].append(gen_mb)
                    generated = (f"beam-5 {tps:7.1f} tok/s {gen_mb:6.0f} MB   (the commands "
                                 f"took {trained - started:.0f} s and "
                                 f"{time.perf_counter() - trained:.0f} s)")
                print(f"  round {r + 1} {c.name:30s} train {wps:8.0f} wps {mb:6.0f} MB   "
                      + (generated or f"(the command took {trained - started:.0f} s)")
                      + f"\n          training {mfu_line(flops[c.name], wps, flops['peak'])}"
                      + (f"\n          training peak {peak_where}" if peak_where else "")
                      + (f"\n          after the first epoch {later_wps:.0f} wps, "
                         + mfu_line(flops[c.name], later_wps, flops["peak"])
                         if later_wps is not None
                         else "\n          (no logged interval after the first epoch)"),
                      flush=True)
                if c.name == OURS and not args.skip_ctranslate2:
                    tps, per_hyp, mb = ctranslate2_run(
                        gen_bin, os.path.join(save, "checkpoint_last.pt"), args.gen_length,
                        args.max_tokens[0], save)
                    ct2["gen_tps"].append(tps)
                    ct2["gen_mb"].append(mb)
                    print(f"  round {r + 1} {'(exported) CTranslate2':30s} beam-5 {tps:7.1f} "
                          f"tok/s {mb:6.0f} MB ({per_hyp:.0f} tokens per hypothesis, export "
                          "included in MB)", flush=True)
            complete = r + 1
    except Stopped:
        print(f"\nbenchmark: stopped (SIGTERM) in round {complete + 1} of {args.rounds}; the "
              f"tables give the {complete} complete rounds", flush=True)
        if complete == 0:
            raise SystemExit("benchmark: error: stopped before the first round was complete")
        for figures in [*results.values(), ct2]:
            for values in figures.values():
                del values[complete:]
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    return results, ct2, complete
