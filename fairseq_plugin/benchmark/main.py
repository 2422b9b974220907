"""annotated-benchmark: speed and memory of annotated_transformer against fairseq's transformer,
side by side.

Both architectures get identical hyper-parameters and data; runs alternate A B B A A B ... over
--rounds rounds in one invocation, and the table gives medians and the median of the per-round
ratios (ours / fairseq's). ``--before DIR`` adds the annotated_transformer of another checkout's
plugin directory to every round (A B C C B A ...), for before/after figures from one run:

- training: target words/s through fairseq-train (median of the logged intervals after the
  first; and of those after the first epoch, when every run logged some: by then each batch's
  shape has been seen, so what a kernel prepares once per shape is done, as in a long run), and
  the process's peak resident memory;
- generation: tokens/s through fairseq-generate --beam 5 (every hypothesis forced to the same
  length with --min-len/--max-len-b, so both do the same work), and peak memory;
- CTranslate2: the annotated_transformer checkpoint exported (annotated-export-fairseq) and
  decoded by CTranslate2 with beam 5, same sentences, batch size and forced length;
- the cache: greedy and beam-5 decoding of annotated_transformer with fairseq's
  SequenceGenerator, with the incremental cache versus recomputing the whole prefix at every
  step (the seeds' way, projecting only the newest position, as the notebook's greedy
  decoding does), at 25, 50, 100 and 200 target tokens.

Data (--data): real parallel text by default, the Tatoeba German-English sample bundled in
examples/tatoeba prepared as the demo prepares it (sacremoses, joint BPE 6k); or ``synthetic``, a
generated corpus with a Zipf-like vocabulary (~6k types) whose source and target lengths (8-40)
are drawn independently, so its batches carry more target padding; or a prepared --data-bin.
The padding share of the training batches is printed: in training the model skips padding in
its position-wise work (projections, feed-forward, layer norms, dropout), so it matters. Sizes: d_model 256, 4+4 layers, d_ff 1024, 4 heads by
default; --preset base|iwslt|multi30k|tiny for others.

Every training run also prints its model FLOPs utilisation (mfu.py): the model FLOPs per
target token, 6 x (encoder layers' parameters x source/target length + decoder layers'
parameters + d_model x vocabulary), from each model's own sizes and the data's lengths, times
the target words/s, over the device's peak (a table by GPU name and precision, --peak-tflops,
or on the CPU the matrix-product rate measured in this process).

--steps-in-process N measures training alone, with less noise: both models' fairseq Trainers in
this one process take the same N batches, alternated step by step (the machine's drift falls on
both alike); --profile-steps K adds torch.profiler's operators of K steps of each, alternated
too, with the time and FLOPs of their matrix products and, on a GPU, the share of the steps'
wall time the GPU was busy (a small share: the host sets the pace). Several --max-tokens sizes
(8192,16384,...) sweep the batch size, size after size, and end in a table of each model's
words/s, MFU and ratio by size: where each stops being bound by the host. --warm-up-epoch
first trains every model on a whole epoch's batches, untimed (every shape seen once: cuDNN's
plans and compiled graphs made, as in a long run), instead of on 3; the timed steps go on into
the next epochs where they need more batches. --also-transformer-without-cudnn adds fairseq's
transformer with cuDNN attention off around its steps, and the ratios take the faster of its
two runs of each batch. It also prints what each model's training
forward keeps for backward (in all, and by the operators that made it where the models differ
most), what one training step holds at its peak beyond what was allocated before it and what is
live then by the line that allocated it (on a GPU from torch.cuda's allocator, cuda_peak.py;
on the CPU by tensor storage, storage_peak.py), on the batch with the most target padding
and on the one with the most positions. On a GPU each training run's
line also says in which step its peak came and what stayed allocated between steps. On the CPU,
--gpu-paths-on-cpu puts annotated_transformer on the paths it takes on a GPU (torch's dropout,
attention's handling of queries with no key), so that what it keeps for backward is as there.

--decoding-in-process times beam 5 of both models' first checkpoints in this process on the same
sources, alternated, split into the time inside the model's per-step calls (decoder step,
reorders) and the rest (encoder, fairseq's SequenceGenerator), then prints torch.profiler's
operators of one decoding of each and a table of where each decoding's time goes (matrix
products, attention, the rest of the model's passes, reorders, SequenceGenerator's own work).

--also-torch-choice adds a third contestant to every round: annotated_transformer trained (and
so decoding) with --fused-attention-backends torch, its fused attention on the backend torch
chooses, cuDNN included, instead of the default no-cudnn (also in --decoding-in-process).
--also-compiled adds annotated_transformer trained with --compile-layers (its layers compiled with
torch.compile for training; decoding steps stay eager), in the rounds and in --steps-in-process;
in the rounds, compiling is part of the first intervals: read the figures after the first epoch.
--also-without-packing adds annotated_transformer trained with --no-packing, its position-wise
work on every position, padding included (decoding is the same either way, so not in
--decoding-in-process): what packing costs or saves through fairseq-train, e.g. on a GPU.
Stopped by SIGTERM (e.g. timeout's) during the rounds, the benchmark stops fairseq's running
command, prints the tables of the rounds complete so far and ends in an error line.

--device cuda runs fairseq on the GPU in --precision fp16 (default there), bf16 or fp32, and
reads peak memory from torch.cuda's allocator over the whole command (cuda_peak.py;
resident memory on the CPU); GPU steps
are fast, so give it more --train-updates (e.g. 200) and a larger --max-tokens (e.g. 8192).
--precision bf16 (on either device) needs a hand with fairseq 0.12, for both models alike:
its --bf16 also switches on --tpu, which the benchmark's fairseq processes switch back off, and
fairseq-generate, which has no bf16, gets the checkpoint's models turned to bf16 as they load
(fairseq_changes.py). Absolute numbers move +-10% between runs on shared machines: read
the ratios.
"""

import argparse
import json
import os
import shutil
import signal
import statistics
import tempfile
import time

from fairseq_plugin import fairseq_changes
from fairseq_plugin.cli.common import plugin_dir

from . import mfu
from .common import (BEFORE, COMPILED, NO_PACKING, OURS, OURS_TORCH_CHOICE, PRESETS, THEIRS,
                     THEIRS_NO_CUDNN, Device, Stopped, alternated, folder_name, raise_stopped,
                     arch_of, training_flags, without_cudnn)
from .data import batch_padding, first_test_sentences, make_data, prepare_tatoeba
from .decoding import print_cache_tables, print_decoding_in_process
from .report import print_ratio_table, step_ratio_line
from .runs import (ABORTED_AFTER_FINISHING, ctranslate2_run, ctranslate2_worker, generate_run,
                   train_run)
from .steps import steps_in_process


def positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number of at least 1")
    return value


def whole_numbers(example: str, what: str):
    """An argparse type: whole numbers of at least 1 separated by commas (``what`` says what they
    are in the error line, ``example`` gives some)."""
    def parse(text: str):
        try:
            return [positive_int(x) for x in text.split(",")]
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(
                f"{text!r}: give {what} of at least 1, separated by commas, e.g. {example}")
    return parse


lengths_list = whole_numbers("25,50,100", "target lengths")  # --cache-lengths
tokens_list = whole_numbers("8192,16384", "whole numbers")  # --max-tokens: one size, or a sweep


def main(argv=None):
    p = argparse.ArgumentParser(prog="annotated-benchmark",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--preset", choices=sorted(PRESETS), default="default")
    p.add_argument("--rounds", type=positive_int, default=4,
                   help="rounds, the order reversed in every other one (an even number gives "
                        "each model the first place equally often)")
    p.add_argument("--data", choices=["tatoeba", "synthetic"], default="tatoeba",
                   help="real parallel text (the bundled Tatoeba sample) or generated data")
    p.add_argument("--data-bin", help="a prepared data-bin instead")
    p.add_argument("--train-sentences", type=positive_int, default=20000)
    p.add_argument("--test-sentences", type=positive_int, default=200,
                   help="generated test sentences, or how many of a test set to decode (its "
                        "first N)")
    p.add_argument("--vocab", type=positive_int, default=6000)
    p.add_argument("--train-updates", type=positive_int, default=25)
    p.add_argument("--max-tokens", type=tokens_list, default="4096",
                   help="tokens per batch; with --steps-in-process several, comma-separated "
                        "(e.g. 8192,16384,32768,65536): a sweep, each size's steps in turn, "
                        "then a table of each model's speed and MFU by size")
    p.add_argument("--gen-length", type=positive_int, default=30,
                   help="target tokens per hypothesis")
    p.add_argument("--cache-lengths", type=lengths_list, default="25,50,100,200")
    p.add_argument("--work-dir", help="keep data and checkpoints here (default: a temp dir)")
    p.add_argument("--skip-cache", action="store_true", help="skip the cache measurements")
    p.add_argument("--skip-generation", action="store_true",
                   help="training only: no fairseq-generate, CTranslate2 or cache measurements "
                        "(training speed and memory in less time)")
    p.add_argument("--skip-ctranslate2", action="store_true",
                   help="skip decoding the exported model with CTranslate2")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: fairseq on the GPU, peak memory from torch.cuda's allocator "
                        "(cuda_peak.py)")
    p.add_argument("--precision", choices=["fp32", "fp16", "bf16"], default=None,
                   help="fairseq's --fp16 or --bf16, or fp32 (default: fp32 on cpu, fp16 on "
                        "cuda); bf16 with fairseq's --tpu switched back off, and fairseq-generate's "
                        "models turned to bf16 as they load (fairseq_changes.py)")
    p.add_argument("--before", metavar="PLUGIN_DIR",
                   help="also run the annotated_transformer of another checkout, e.g. "
                        "../old/fairseq_plugin (git worktree add ../old COMMIT), in the same "
                        "rounds: before/after figures from one run")
    p.add_argument("--steps-in-process", type=positive_int, metavar="N",
                   help="training only, precise: both models in this process on the same N "
                        "batches, alternated step by step; prints the step times and ratios")
    p.add_argument("--profile-steps", type=positive_int, metavar="K",
                   help="with --steps-in-process: also torch.profiler's operators for K steps "
                        "of each, alternated, and the time and FLOPs of their matrix products")
    p.add_argument("--warm-up-epoch", action="store_true",
                   help="with --steps-in-process: each model first trains on a whole epoch's "
                        "batches, untimed (every batch shape seen once, as after a long run's "
                        "first epoch), instead of on 3")
    p.add_argument("--without-packing", action="store_true",
                   help="with --steps-in-process: also time annotated_transformer computing the "
                        "padding (packing off), alternated with the others")
    p.add_argument("--gpu-paths-on-cpu", action="store_true",
                   help="with --steps-in-process on the CPU: annotated_transformer takes the paths "
                        "it takes on a GPU (torch's dropout, attention's handling of queries with "
                        "no key), so that what it keeps for backward is as there")
    p.add_argument("--decoding-in-process", action="store_true",
                   help="beam 5 of both first-round checkpoints in this process, alternated: the "
                        "time in the model's per-step calls and in SequenceGenerator, and "
                        "torch.profiler's operators of each")
    p.add_argument("--no-cudnn-attention", action="store_true",
                   help="on a GPU, keep torch from choosing its cuDNN attention backend, for "
                        "both models (torch.backends.cuda.enable_cudnn_sdp(False) in every "
                        "process): it builds a cuDNN graph for each new shape of the inputs")
    p.add_argument("--also-transformer-without-cudnn", action="store_true",
                   help="on a GPU, also run fairseq's transformer with torch's cuDNN attention "
                        "backend off in its processes, in every round; its ratios are then taken "
                        "against the better of fairseq's two runs in each round (the fair "
                        "baseline: cuDNN builds a plan for each new shape)")
    p.add_argument("--also-torch-choice", action="store_true",
                   help="also run annotated_transformer with --fused-attention-backends torch in "
                        "every round (A B C, C B A, ...): its fused attention on the backend torch "
                        "chooses, which may be cuDNN on a GPU, instead of the default no-cudnn")
    p.add_argument("--also-without-packing", action="store_true",
                   help="also run annotated_transformer with --no-packing in every round: in "
                        "training, its position-wise work on every position, padding included")
    p.add_argument("--also-compiled", action="store_true",
                   help="also run annotated_transformer with --compile-layers, its layers "
                        "compiled with torch.compile, in every round (and in --steps-in-process)")
    p.add_argument("--peak-tflops", type=float, metavar="TFLOPS",
                   help="the device's peak in TFLOP/s for the MFU figures (default: a table of "
                        "GPUs by name, or on the CPU its measured matrix-product rate)")
    p.add_argument("--ctranslate2-worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if ((args.profile_steps or args.without_packing or args.gpu_paths_on_cpu
         or args.warm_up_epoch) and args.steps_in_process is None):
        p.error("--profile-steps, --without-packing, --gpu-paths-on-cpu and --warm-up-epoch go "
                "with --steps-in-process N")
    if args.profile_steps and args.profile_steps > args.steps_in_process:
        p.error(f"--profile-steps {args.profile_steps}: at most the {args.steps_in_process} steps "
                f"of --steps-in-process")
    if len(args.max_tokens) > 1 and args.steps_in_process is None:
        p.error(f"--max-tokens {','.join(map(str, args.max_tokens))}: several sizes (a sweep) go "
                f"with --steps-in-process N; give one size for the rounds")
    args.sweep, args.max_tokens = args.max_tokens, args.max_tokens[0]
    if args.skip_generation and args.decoding_in_process:
        p.error("--skip-generation --decoding-in-process: the second decodes; leave out one")
    if args.ctranslate2_worker:
        return ctranslate2_worker(*json.loads(args.ctranslate2_worker))

    import torch

    if args.also_transformer_without_cudnn and (args.device == "cpu" or args.no_cudnn_attention):
        p.error("--also-transformer-without-cudnn: for a GPU run with cuDNN attention allowed; "
                "add --device cuda, leave out --no-cudnn-attention")
    if args.no_cudnn_attention and args.device == "cpu":
        p.error("--no-cudnn-attention: the cuDNN attention backend exists on a GPU only; add "
                "--device cuda")
    if args.gpu_paths_on_cpu and args.device != "cpu":
        p.error("--gpu-paths-on-cpu: on a GPU the model takes them anyway; leave it out there")
    device = Device(args.device, args.precision or ("fp32" if args.device == "cpu" else "fp16"),
                    cudnn_attention=not args.no_cudnn_attention)
    if not device.cudnn_attention:  # in this process too (in-process steps and decoding)
        torch.backends.cuda.enable_cudnn_sdp(False)
    if device.precision == "bf16":  # (in-process steps parse fairseq-train's flags here)
        fairseq_changes.install([change.name for change in fairseq_changes.BENCHMARK_BF16])
    if device.kind == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA GPU here (torch.cuda.is_available() is False)")
    if args.skip_generation:  # (no checkpoint is decoded)
        args.skip_ctranslate2 = args.skip_cache = True
    if device.kind == "cuda" and not args.skip_ctranslate2 and args.steps_in_process is None:
        p.error("the CTranslate2 comparison runs on the CPU only: add --skip-ctranslate2")
    if args.work_dir and os.path.isdir(args.work_dir) and os.listdir(args.work_dir):
        p.error(f"--work-dir {args.work_dir} is not empty (fairseq-train would resume its "
                "checkpoints); give a new or empty directory, and --data-bin DIR to reuse "
                "prepared data")
    if args.work_dir and os.path.exists(args.work_dir) and not os.path.isdir(args.work_dir):
        p.error(f"--work-dir {args.work_dir} is a file; give a new or empty directory")
    for option, folder, made_by in (
            ("--data-bin", args.data_bin, "fairseq-preprocess or annotated-prepare"),
            ("--before", args.before, "a checkout's fairseq_plugin folder")):
        if folder and not os.path.isdir(folder):
            p.error(f"{option} {folder}: no such folder; give one made by {made_by}")
    if args.data_bin and not any(f.startswith("test.") for f in os.listdir(args.data_bin)):
        p.error(f"--data-bin {args.data_bin} has no test split (test.*) to decode; binarise one "
                f"with --testpref")
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
    src_pad, tgt_pad, n_test = batch_padding(data_bin, args.max_tokens)
    n_decoded = min(n_test, args.test_sentences)
    gen_bin = (data_bin if n_decoded == n_test or args.skip_generation
               else first_test_sentences(data_bin, n_decoded, work))
    print(f"benchmark: preset {args.preset} {PRESETS[args.preset]} (layers, d_model, d_ff, "
          f"heads), {args.rounds} rounds, {device.kind} {device.precision}"
          f"{'' if device.cudnn_attention else ' without cuDNN attention'}"
          f"{' (annotated_transformer on its GPU paths)' if args.gpu_paths_on_cpu else ''}, "
          f"data {data_bin}, "
          f"torch threads {os.environ.get('OMP_NUM_THREADS', 'default')}\n"
          f"training batches: {src_pad:.1%} source and {tgt_pad:.1%} target positions are "
          f"padding; " + ("training only (--skip-generation)" if args.skip_generation else
                          f"decoding the first {n_decoded} of {n_test} test sentences"),
          flush=True)
    flops = model_flops(data_bin, args.preset, args.max_tokens, device, args.peak_tflops)
    if args.steps_in_process:
        sweep = {}
        for max_tokens in args.sweep:
            if len(args.sweep) > 1:
                src_pad, tgt_pad, _ = batch_padding(data_bin, max_tokens)
                print(f"\n--max-tokens {max_tokens}: {src_pad:.1%} source and {tgt_pad:.1%} "
                      f"target positions are padding", flush=True)
            seconds, tokens = steps_in_process(
                data_bin, args.preset, max_tokens, args.steps_in_process, args.profile_steps,
                device, args.without_packing, gpu_paths=args.gpu_paths_on_cpu,
                compiled=args.also_compiled, warm_up_epoch=args.warm_up_epoch,
                transformer_without_cudnn=args.also_transformer_without_cudnn)
            sweep[max_tokens] = print_step_times(seconds, tokens, flops)
            release_memory(device)
        if len(args.sweep) > 1:
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
        print_cache_tables(first_round, data_bin, args.cache_lengths, args.gen_length, device)
    if args.decoding_in_process:
        names = (OURS, THEIRS) + ((OURS_TORCH_CHOICE,) if args.also_torch_choice else ())
        print_decoding_in_process({name: first_round[name] for name in names}, data_bin,
                                  args.gen_length, device)


def model_flops(data_bin, preset, max_tokens, device, peak_tflops=None):
    """{"peak": FLOP/s or None, arch: model FLOPs per target token} for both architectures, each
    from its own model's sizes (mfu.py), printed with the device's peak."""
    ratio = mfu.source_per_target(data_bin)
    flops = {"peak": None}
    for arch in (OURS, THEIRS):
        model = mfu.built_model(training_flags(data_bin, arch, preset, max_tokens, plugin_dir(),
                                               device))
        flops[arch] = mfu.flops_per_target_token(model, ratio)
        n_enc, n_dec, output = mfu.layer_parameters(model)
        print(f"{arch}: {flops[arch] / 1e9:.4g} GFLOP per target token = 6 x ({n_enc:,} encoder "
              f"layer parameters x {ratio:.2f} source tokens per target token + {n_dec:,} decoder "
              f"layer parameters + {output:,} of the output projection)")
    flops["peak"], source = mfu.device_peak(device, peak_tflops)
    print("peak: " + (f"{flops['peak'] / 1e12:.4g} TFLOP/s, " if flops["peak"] else "")
          + source, flush=True)
    return flops


def print_step_times(seconds, tokens, flops):
    """--steps-in-process's lines: each model's median step and its ratio to fairseq's, and
    each model's FLOP/s over the timed steps. Returns {name: (target words/s over the timed
    steps, median of the per-step ratios fairseq's step / this one's)}. With THEIRS_NO_CUDNN
    among them, fairseq's step in the ratios is the faster of its two runs of each batch."""
    ours, theirs = seconds[OURS], seconds[THEIRS]
    print(f"\n{len(ours)} training steps each, alternated: {OURS} median "
          f"{1000 * statistics.median(ours):.0f} ms, {THEIRS} median "
          f"{1000 * statistics.median(theirs):.0f} ms")
    if THEIRS_NO_CUDNN in seconds:
        theirs = [min(a, b) for a, b in zip(theirs, seconds[THEIRS_NO_CUDNN])]
        print(f"{THEIRS_NO_CUDNN}: median {1000 * statistics.median(seconds[THEIRS_NO_CUDNN]):.0f}"
              f" ms; in the ratios, {THEIRS}'s step is the faster of its two runs of each batch "
              f"(median {1000 * statistics.median(theirs):.0f} ms)")
    print(step_ratio_line(OURS, ours, theirs))
    for name in (NO_PACKING, COMPILED):
        if name in seconds:
            print(f"{name}: median {1000 * statistics.median(seconds[name]):.0f} ms; "
                  f"{step_ratio_line(name, seconds[name], theirs)}")
    for name, times in seconds.items():
        arch = arch_of(name)
        print(f"{name}: {tokens / sum(times):.0f} target words/s over the timed steps, "
              + mfu.utilisation(flops[arch], tokens / sum(times), flops["peak"]), flush=True)
    return {name: (tokens / sum(times), statistics.median(b / a for a, b in zip(times, theirs)))
            for name, times in seconds.items()}


def release_memory(device):
    """Between the sizes of a sweep: the last size's trainers are gone; on a GPU, their cached
    blocks go back too, so that each size's peak is its own."""
    import gc

    import torch

    gc.collect()
    if device.kind == "cuda":
        torch.cuda.empty_cache()


def print_sweep_table(sweep, flops, steps):
    """The --max-tokens sweep: by batch size, each model's target words/s over its timed steps,
    its MFU where the peak is known, and its median per-step ratio against fairseq's
    transformer (the faster of its runs with and without cuDNN attention, where both ran).
    ``sweep``: {max_tokens: print_step_times's dict}."""
    names = list(next(iter(sweep.values())))
    ours = [name for name in names if arch_of(name) != THEIRS]
    print(f"\n| --max-tokens ({steps} steps each, alternated) | "
          + " | ".join(f"{name} words/s" + (" (MFU)" if flops["peak"] else "") for name in names)
          + " | " + " | ".join(f"{name} / {THEIRS}" for name in ours) + " |")
    print("|---" * (1 + len(names) + len(ours)) + "|")
    for max_tokens, figures in sweep.items():
        cells = []
        for name in names:
            words = figures[name][0]
            share = flops[arch_of(name)] * words / flops["peak"] if flops["peak"] else None
            cells.append(f"{words:.0f}" + (f" ({share:.1%})" if share is not None else ""))
        cells += [f"{figures[name][1]:.2f}x" for name in names if arch_of(name) != THEIRS]
        print(f"| {max_tokens} | " + " | ".join(cells) + " |")


def contestants_of(args):
    """(name, --arch, --user-dir, more model flags) of each model in the rounds: ours and
    fairseq's; --before adds another checkout's plugin, --also-torch-choice ours with
    --fused-attention-backends torch, --also-without-packing ours with --no-packing,
    --also-compiled ours with --compile-layers,
    --also-transformer-without-cudnn fairseq's with cuDNN attention off (THEIRS_NO_CUDNN)."""
    contestants = [(OURS, OURS, plugin_dir(), []), (THEIRS, THEIRS, plugin_dir(), [])]
    if args.before:
        contestants.append((BEFORE, OURS, os.path.abspath(args.before), []))
    if args.also_torch_choice:
        contestants.append((OURS_TORCH_CHOICE, OURS, plugin_dir(),
                            ["--fused-attention-backends", "torch"]))
    if args.also_without_packing:
        contestants.append((NO_PACKING, OURS, plugin_dir(), ["--no-packing"]))
    if args.also_compiled:
        contestants.append((COMPILED, OURS, plugin_dir(), ["--compile-layers"]))
    if args.also_transformer_without_cudnn:
        contestants.append((THEIRS_NO_CUDNN, THEIRS, plugin_dir(), []))
    return contestants


def rounds(args, device, work, data_bin, gen_bin, n_decoded, flops):
    """The rounds of fairseq-train and fairseq-generate, the order alternated: returns
    ({name: {figure: [one per round]}}, CTranslate2's {figure: [...]}, the rounds complete)."""
    contestants = contestants_of(args)
    results = {name: {"train_wps": [], "later_wps": [], "train_mb": [], "gen_tps": [],
                      "gen_mb": []}
               for name, _, _, _ in contestants}
    ct2 = {"gen_tps": [], "gen_mb": []}
    complete = 0
    signal.signal(signal.SIGTERM, raise_stopped)
    try:
        for r in range(args.rounds):
            for name, arch, user_dir, flags in alternated(contestants, r):
                save = os.path.join(work, f"{folder_name(name)}-round{r}")
                started = time.perf_counter()
                # (fairseq's transformer without cuDNN attention: in its own processes)
                runs_on = without_cudnn(device) if name == THEIRS_NO_CUDNN else device
                wps, later_wps, mb, peak_where = train_run(
                    data_bin, arch, args.preset, save, args.train_updates, args.max_tokens,
                    user_dir, runs_on, flags)
                trained = time.perf_counter()
                res = results[name]
                res["train_wps"].append(wps)
                res["later_wps"].append(later_wps)
                res["train_mb"].append(mb)
                generated = ""
                if not args.skip_generation:
                    tps, gen_mb = generate_run(gen_bin, os.path.join(save, "checkpoint_last.pt"),
                                               args.gen_length, args.max_tokens, user_dir,
                                               n_decoded, runs_on)
                    res["gen_tps"].append(tps)
                    res["gen_mb"].append(gen_mb)
                    generated = (f"beam-5 {tps:7.1f} tok/s {gen_mb:6.0f} MB   (the commands "
                                 f"took {trained - started:.0f} s and "
                                 f"{time.perf_counter() - trained:.0f} s)")
                print(f"  round {r + 1} {name:30s} train {wps:8.0f} wps {mb:6.0f} MB   "
                      + (generated or f"(the command took {trained - started:.0f} s)")
                      + f"\n          training {mfu.utilisation(flops[arch], wps, flops['peak'])}"
                      + (f"\n          training peak {peak_where}" if peak_where else "")
                      + (f"\n          after the first epoch {later_wps:.0f} wps, "
                         + mfu.utilisation(flops[arch], later_wps, flops["peak"])
                         if later_wps is not None
                         else "\n          (no logged interval after the first epoch)"),
                      flush=True)
                if name == OURS and not args.skip_ctranslate2:
                    tps, per_hyp, mb = ctranslate2_run(
                        gen_bin, os.path.join(save, "checkpoint_last.pt"), args.gen_length,
                        args.max_tokens, save)
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
