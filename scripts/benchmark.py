#!/usr/bin/env python
"""Speed and memory of annotated_transformer against fairseq's transformer, side by side.

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

--steps-in-process N measures training alone, with less noise: both models' fairseq Trainers in
this one process take the same N batches, alternated step by step (the machine's drift falls on
both alike); --profile-steps K adds torch.profiler's operators of K steps of each, alternated
too, with the time and FLOPs of their matrix products. It also prints what each model's training
forward keeps for backward (in all, and by the operators that made it where the models differ
most), what one training step holds at its peak beyond what was allocated before it and what is
live then by the line that allocated it (on a GPU from torch.cuda's allocator, scripts/cuda_peak.py;
on the CPU by tensor storage, scripts/storage_peak.py), on the batch with the most target padding
and on the one with the most positions. On a GPU each training run's
line also says in which step its peak came and what stayed allocated between steps. On the CPU,
--gpu-paths-on-cpu puts annotated_transformer on the paths it takes on a GPU (torch's dropout,
attention's handling of queries with no key), so that what it keeps for backward is as there.

--decoding-in-process times beam 5 of both models' first checkpoints in this process on the same
sources, alternated, split into the time inside the model's per-step calls (decoder step,
reorders) and the rest (encoder, fairseq's SequenceGenerator), then prints torch.profiler's
operators of one decoding of each: where a GPU's beam search spends its time.

--also-torch-choice adds a third contestant to every round: annotated_transformer trained (and
so decoding) with --fused-attention-backends torch, its fused attention on the backend torch
chooses, cuDNN included, instead of the default no-cudnn (also in --decoding-in-process).
--also-without-packing adds annotated_transformer trained with --no-packing, its position-wise
work on every position, padding included (decoding is the same either way, so not in
--decoding-in-process): what packing costs or saves through fairseq-train, e.g. on a GPU.
Stopped by SIGTERM (e.g. timeout's) during the rounds, the benchmark stops fairseq's running
command, prints the tables of the rounds complete so far and ends in an error line.

--device cuda runs fairseq on the GPU in --precision fp16 (default there), bf16 or fp32, and
reads peak memory from torch.cuda's allocator over the whole command (scripts/cuda_peak.py;
resident memory on the CPU); GPU steps
are fast, so give it more --train-updates (e.g. 200) and a larger --max-tokens (e.g. 8192).
--precision bf16 (on either device) needs a hand with fairseq 0.12, for both models alike:
its --bf16 also switches on --tpu, which the benchmark's fairseq processes switch back off, and
fairseq-generate, which has no bf16, gets the checkpoint's models turned to bf16 as they load
(scripts/fairseq_bf16.py). Absolute numbers move +-10% between runs on shared machines: read
the ratios.
"""

import argparse
import contextlib
import itertools
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from fairseq_plugin.cli.common import fairseq_cli, plugin_dir

# the scripts beside this one (cli_process, cuda_peak, fairseq_bf16), also when it is loaded by
# its path
SCRIPTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, SCRIPTS)
import cli_process  # noqa: E402  (cli_process and cuda_peak import nothing else;
import cuda_peak  # noqa: E402  fairseq_bf16 and storage_peak import fairseq or torch: on demand)

PRESETS = {  # layers, d_model, d_ff, heads
    "default": (4, 256, 1024, 4),
    "tiny": (2, 64, 256, 4),
    "iwslt": (6, 512, 1024, 4),
    "base": (6, 512, 2048, 8),
    "multi30k": (3, 256, 512, 8),  # examples/multi30k's model
}
OURS, THEIRS, BEFORE = "annotated_transformer", "transformer", "annotated_transformer@before"
NO_PACKING = "annotated_transformer without packing"  # computing padding, as fairseq's does
OURS_TORCH_CHOICE = "annotated_transformer torch-choice"  # --fused-attention-backends torch


def zipf_corpus(path, n_sentences, vocab, rng, min_len=8, max_len=40, exponent=1.1):
    weights = [1.0 / (r ** exponent) for r in range(1, vocab + 1)]
    words = [f"w{r}" for r in range(vocab)]
    with open(path, "w") as f:
        for _ in range(n_sentences):
            f.write(" ".join(rng.choices(words, weights, k=rng.randint(min_len, max_len))) + "\n")


def make_data(work, n_train, n_test, vocab, seed=1):
    rng = random.Random(seed)
    raw = os.path.join(work, "raw")
    os.makedirs(raw, exist_ok=True)
    for split, n in (("train", n_train), ("valid", 200), ("test", n_test)):
        for lang in ("src", "tgt"):
            zipf_corpus(os.path.join(raw, f"{split}.{lang}"), n, vocab, rng)
    dest = os.path.join(work, "data-bin")
    subprocess.run([fairseq_cli("fairseq-preprocess"), "--source-lang", "src", "--target-lang",
                    "tgt", "--trainpref", f"{raw}/train", "--validpref", f"{raw}/valid",
                    "--testpref", f"{raw}/test", "--destdir", dest, "--joined-dictionary",
                    "--workers", "2"], check=True, capture_output=True)
    return dest


def prepare_tatoeba(work):
    """The bundled Tatoeba sample, prepared as scripts/translation_demo.py prepares it."""
    from fairseq_plugin.cli.prepare import prepare

    raw = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                       "tatoeba", "data")
    dest = os.path.join(work, "tatoeba-bin")
    prepare(raw, dest, "de", "en", {"train": "train", "valid": "valid", "test": "test"},
            bpe_merges=6000, force=True)
    return dest


def batch_padding(data_bin, max_tokens, split="train"):
    """(source, target) share of padded positions in fairseq-train's batches of ``split`` (fairseq's
    own length ordering and batching, --required-batch-size-multiple 8), and the sentences in
    the test set."""
    from fairseq.data import Dictionary, LanguagePairDataset, data_utils

    src, tgt = data_utils.infer_language_pair(data_bin)
    d_src = Dictionary.load(os.path.join(data_bin, f"dict.{src}.txt"))
    d_tgt = Dictionary.load(os.path.join(data_bin, f"dict.{tgt}.txt"))
    load = lambda s, lang, d: data_utils.load_indexed_dataset(  # noqa: E731
        os.path.join(data_bin, f"{s}.{src}-{tgt}.{lang}"), d)
    s_ds, t_ds = load(split, src, d_src), load(split, tgt, d_tgt)
    pairs = LanguagePairDataset(s_ds, s_ds.sizes, d_src, t_ds, t_ds.sizes, d_tgt)
    batches = pairs.batch_by_size(pairs.ordered_indices(), max_tokens=max_tokens,
                                  required_batch_size_multiple=8)
    shares = []
    for sizes in (s_ds.sizes, t_ds.sizes):
        real = sum(int(sizes[b].sum()) for b in batches)
        total = sum(len(b) * int(sizes[b].max()) for b in batches)
        shares.append(1.0 - real / total)
    return shares[0], shares[1], len(load("test", src, d_src))


def first_test_sentences(data_bin, n, work):
    """A data-bin under ``work`` whose test set is the first n sentence pairs of ``data_bin``'s
    (its dictionaries copied), for decoding n sentences (fairseq-generate has no option for a part
    of a split: its --num-shards follows --distributed-world-size, not the flag)."""
    from fairseq.data import Dictionary, data_utils, indexed_dataset

    src, tgt = data_utils.infer_language_pair(data_bin)
    dest = os.path.join(work, f"test-first-{n}")
    os.makedirs(dest, exist_ok=True)
    for lang in (src, tgt):
        shutil.copy(os.path.join(data_bin, f"dict.{lang}.txt"), dest)
        dictionary = Dictionary.load(os.path.join(data_bin, f"dict.{lang}.txt"))
        prefix = f"test.{src}-{tgt}.{lang}"
        sentences = data_utils.load_indexed_dataset(os.path.join(data_bin, prefix), dictionary)
        if getattr(sentences, "supports_prefetch", False):  # --dataset-impl cached / lazy
            sentences.prefetch(range(n))
        out = os.path.join(dest, prefix)
        builder = indexed_dataset.make_builder(indexed_dataset.data_file_path(out), impl="mmap",
                                               vocab_size=len(dictionary))
        for i in range(n):
            builder.add_item(sentences[i])
        builder.finalize(indexed_dataset.index_file_path(out))
    return dest


def model_flags(preset):
    layers, d, ff, heads = PRESETS[preset]
    return ["--encoder-layers", layers, "--decoder-layers", layers, "--encoder-embed-dim", d,
            "--decoder-embed-dim", d, "--encoder-ffn-embed-dim", ff, "--decoder-ffn-embed-dim",
            ff, "--encoder-attention-heads", heads, "--decoder-attention-heads", heads,
            "--share-all-embeddings", "--dropout", "0.1"]


# Set-ups of the Python process that runs one of fairseq's CLIs, for both models alike (the
# scripts beside this one imported from there too):
# the GPU memory peak over the whole command (scripts/cuda_peak.py: fairseq's trainer resets
# torch's peak counter after every step), printed at exit; cuBLAS set up first (a matrix product:
# otherwise the first one inside the CLI's timed work pays for it)
CUDA_PEAK = "import cuda_peak; cuda_peak.switch_on(); "
# torch's cuDNN attention backend switched off
NO_CUDNN_ATTENTION = "torch.backends.cuda.enable_cudnn_sdp(False); "
# fairseq's CLIs in bf16 (scripts/fairseq_bf16.py)
IN_BF16 = "import fairseq_bf16; fairseq_bf16.switch_on(); "
BF16_MODELS = "fairseq_bf16: the models in torch.bfloat16"  # what fairseq_bf16 prints


class Device:
    """Where fairseq runs: its flags, and how its peak memory is read (the process's resident
    memory on the CPU, torch.cuda's allocator on a GPU: CUDA_PEAK); on a GPU, whether torch may
    choose its cuDNN attention backend."""

    def __init__(self, kind: str = "cpu", precision: str = "fp32", cudnn_attention: bool = True):
        self.kind, self.precision, self.cudnn_attention = kind, precision, cudnn_attention

    def flags(self):
        return (["--cpu"] if self.kind == "cpu" else []) + (
            [] if self.precision == "fp32" else [f"--{self.precision}"])

    def command(self, cmd):
        """fairseq's command ``cmd`` as run here: on a GPU, or in bf16, in a Python that sets up
        the process first (CUDA_PEAK, NO_CUDNN_ATTENTION, IN_BF16)."""
        setup = ((CUDA_PEAK if self.kind == "cuda" else "")
                 + ("" if self.cudnn_attention else NO_CUDNN_ATTENTION)
                 + (IN_BF16 if self.precision == "bf16" else ""))
        if not setup:
            return cmd
        # -X faulthandler: an abort prints each Python thread's stack (run_measured shows it)
        return [sys.executable, "-X", "faulthandler", "-c", "import sys, torch; "
                f"sys.argv = sys.argv[1:]; sys.path.insert(0, {SCRIPTS!r}); {setup}"
                "import cli_process; cli_process.run(sys.argv[0])", *cmd]

    def peak_mb(self, out: str, rss_mb: float) -> float:
        if self.kind == "cpu":
            return rss_mb
        return float(self.peak_line(out).split()[0])

    def peak_where(self, out: str) -> str:
        """On a GPU, when a training command's peak came and what was allocated between its steps
        (cuda_peak.PeakCounter.where): whether a gap is in the steps or in what stays."""
        return "" if self.kind == "cpu" else self.peak_line(out).split(None, 1)[1]

    @staticmethod
    def peak_line(out: str) -> str:
        """The end of cuda_peak's line at exit: 'MiB when...'."""
        return out.rsplit(cuda_peak.PRINTED + " ", 1)[1].splitlines()[0]


CPU = Device()


def folder_name(contestant: str) -> str:
    """A contestant's name as a folder name: annotated_transformer, annotated_transformer-before,
    annotated_transformer-torch-choice, annotated_transformer-without-packing, transformer."""
    return re.sub(r"[^\w.-]+", "-", contestant)


class Stopped(Exception):
    """SIGTERM (e.g. from timeout) during the rounds: the tables give the complete rounds."""


def raise_stopped(signum, frame):
    raise Stopped()


def alternated(contestants, i):
    """The order of round (or step) i: as given, reversed, as given, ... (A B C, C B A, ...)."""
    return contestants if i % 2 == 0 else contestants[::-1]


ABORTED_AFTER_FINISHING = []  # the commands that did (names), for the summary


def report_abort_after_finishing(name: str, out: str) -> None:
    """A command that finished its work and then aborted in Python's shutdown (cli_process.py):
    its figures stand; say so, with the Python threads alive when its script had finished and
    what faulthandler printed of its threads at the abort."""
    ABORTED_AFTER_FINISHING.append(name)
    alive = [line for line in out.splitlines() if line.startswith(cli_process.THREADS_ALIVE)]
    dump = out[out.find("Fatal Python error"):] if "Fatal Python error" in out else ""
    print(f"  note: {name} finished (exit status 0), then aborted in Python's shutdown (SIGABRT); "
          "its figures are kept (scripts/cli_process.py)"
          + "".join("\n  " + line for line in alive[-1:])
          + ("\n  its threads at the abort:\n" + "\n".join(dump.splitlines()[:40]) if dump else ""),
          flush=True)


def run_measured(cmd, device=CPU):
    """Run a command; return (stdout + stderr, peak memory in MB)."""
    name = os.path.basename(str(cmd[0]))
    cmd = device.command([str(c) for c in cmd])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
    except BaseException:  # e.g. Stopped: the command does not outlive the benchmark
        proc.kill()
        proc.wait()
        raise
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode == -signal.SIGABRT and cli_process.FINISHED in out:
        report_abort_after_finishing(name, out)
    elif proc.returncode != 0:
        sys.stderr.write(out[-3000:])
        raise SystemExit(f"benchmark: error: {name} failed (its output's end is above)")
    return out, device.peak_mb(out, usage.ru_maxrss / 1024.0)


def training_flags(data_bin, arch, preset, max_tokens, user_dir, device=CPU):
    """fairseq-train's arguments for both architectures (the same but for --arch)."""
    return [data_bin, "--user-dir", user_dir, "--arch", arch, *model_flags(preset),
            "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
            "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--lr", "5e-4",
            "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "100",
            "--max-tokens", max_tokens, "--seed", "1", *device.flags(), "--num-workers", "0"]


def train_run(data_bin, arch, preset, save_dir, updates, max_tokens, user_dir, device=CPU,
              model_flags=()):
    """fairseq-train for ``updates`` updates (``model_flags``: more of the model's flags, which the
    checkpoint keeps for generation): (target words/s, the same after the first epoch or None,
    peak MB, on a GPU when the peak came)."""
    out, rss = run_measured([
        fairseq_cli("fairseq-train"),
        *training_flags(data_bin, arch, preset, max_tokens, user_dir, device), *model_flags,
        # one checkpoint, at the end, without the optimizer's state (decoding needs no more)
        "--max-update", updates, "--save-dir", save_dir, "--no-epoch-checkpoints",
        "--save-interval", "1000000", "--no-save-optimizer-state", "--disable-validation", "--log-format", "json", "--log-interval", "5"], device)
    wps, later = training_speeds(out)
    return wps, later, rss, device.peak_where(out)


def training_speeds(out: str):
    """From fairseq-train's json log (``train_inner``, every --log-interval updates): the median
    target words/s of its intervals but the first, and of those after the first epoch but the
    first of them (None where there are none). After the first epoch every batch's shape has been
    seen once, so what a kernel prepares once per shape (cuDNN's attention plans, in fairseq's
    transformer on a GPU) is done: the pace of a long training run."""
    logged = [json.loads(line[line.index("{"):])
              for line in out.splitlines() if "train_inner" in line and "{" in line]
    if len(logged) < 2:
        raise SystemExit("benchmark: error: too few logged intervals; raise --train-updates")
    later = [float(stats["wps"]) for stats in logged if int(stats["epoch"]) > 1][1:]
    return (statistics.median(float(stats["wps"]) for stats in logged[1:]),
            statistics.median(later) if later else None)


def fairseq_trainer(flags):
    """fairseq's Trainer (model, criterion, optimizer) built in this process from fairseq-train's
    command-line flags, and its task."""
    from fairseq import options, tasks, utils
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.trainer import Trainer

    args = options.parse_args_and_arch(options.get_training_parser(), [str(f) for f in flags])
    cfg = convert_namespace_to_omegaconf(args)
    utils.import_user_module(cfg.common)
    task = tasks.setup_task(cfg.task)
    task.load_dataset("train")
    return Trainer(cfg, task, task.build_model(cfg.model), task.build_criterion(cfg.criterion))


def steps_in_process(data_bin, preset, max_tokens, steps, profile_steps=0, device=CPU,
                     without_packing=False, memory=None, gpu_paths=False):
    """Training steps of both models in one process on the same batches, alternated step by step
    (A B, B A, ...), so that the machine's drift falls on both alike. Returns {name: [seconds of
    each step]}; with ``profile_steps``, then profiles that many steps of each (print_profiles).
    ``without_packing`` adds annotated_transformer computing padding too (NO_PACKING). ``memory``
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
        import storage_peak
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
    return seconds


def step_peak_mib(trainer, sample, memory) -> float:
    """MiB that one training step of ``sample`` holds at its peak beyond what was allocated before
    it (the parameters, the optimizer's state): where two models of the same parameters differ in
    peak memory. Whole runs' peaks (train_run) add what stays allocated between steps."""
    return memory.peak_of(lambda: trainer.train_step([sample])) / 2 ** 20


def print_memory(trainers, sample, batch: str, memory=None, rows: int = 8) -> None:
    """What each model's training forward of ``sample`` keeps for backward, in all and by the
    operators that made it (the ``rows`` where the models differ most), and with ``memory`` (on
    a GPU a cuda_peak.PeakCounter, on the CPU a storage_peak.StoragePeakCounter) what one
    training step of it holds at its peak."""
    kept = {name: kept_for_backward(trainer, sample) for name, trainer in trainers.items()}
    mib = {name: sum(by_maker.values()) for name, by_maker in kept.items()}
    print(f"\nkept for backward by one training forward of {batch} (distinct storages, parameters "
          "excluded): " + ", ".join(f"{name} {m:.1f} MiB" for name, m in mib.items())
          + f"; {OURS} / {THEIRS}: {mib[OURS] / mib[THEIRS]:.2f}x")
    makers = sorted(set(kept[OURS]) | set(kept[THEIRS]),
                    key=lambda k: -abs(kept[OURS].get(k, 0.0) - kept[THEIRS].get(k, 0.0)))
    print(f"| made by (grad_fn, dtype) | {OURS}, MiB | {THEIRS}, MiB |\n|---|---|---|")
    for maker in makers[:rows]:
        print(f"| {maker} | {kept[OURS].get(maker, 0.0):.1f} | {kept[THEIRS].get(maker, 0.0):.1f} |")
    if memory is not None:
        peak = {name: step_peak_mib(trainer, sample, memory) for name, trainer in trainers.items()}
        print("held at its peak by one training step of that batch (forward, backward, update), "
              "beyond what was allocated before it: " + ", ".join(
                  f"{name} {m:.1f} MiB" for name, m in peak.items())
              + f"; {OURS} / {THEIRS}: {peak[OURS] / peak[THEIRS]:.2f}x")


def print_live_at_peak(trainers, sample, batch: str, memory, rows: int = 8) -> None:
    """What is live at the peak of one more training step of ``sample`` by each model
    (``memory``'s live_at_peak_of, as in print_memory): the ``rows`` lines that had allocated
    the most then, and the rest together."""
    for name, trainer in trainers.items():
        peak, by_line = memory.live_at_peak_of(lambda: trainer.train_step([sample]))
        top = sorted(by_line.items(), key=lambda item: -abs(item[1]))
        print(f"\nlive at the peak of {name}'s step of {batch} ({peak / 2 ** 20:.1f} MiB beyond "
              "what was allocated before it), by the line that allocated it:\n"
              "| MiB | allocated at |\n|---|---|")
        for line, n_bytes in top[:rows]:
            print(f"| {n_bytes / 2 ** 20:.1f} | {line} |")
        if len(top) > rows:
            rest = sum(n_bytes for _, n_bytes in top[rows:])
            print(f"| {rest / 2 ** 20:.1f} | {len(top) - rows} other lines |")


def kept_for_backward(trainer, sample) -> dict:
    """MiB of activations that autograd keeps for the backward of one training forward (model
    and criterion) of ``sample`` (most of what training holds at its peak beyond the parameters
    and the optimizer's state), by what made each tensor: {"its grad_fn's name dtype": MiB}
    ("no grad": made outside autograd, e.g. a dropout mask)."""
    import torch

    sample = trainer._prepare_sample(sample)[0]
    storages = {}

    def keep(t):
        maker = type(t.grad_fn).__name__ if t.grad_fn is not None else (
            "leaf" if t.requires_grad else "no grad")
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = (storage.nbytes(),
                                        f"{maker} {str(t.dtype).replace('torch.', '')}")
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        trainer.criterion(trainer.model, sample)
    parameters = {p.untyped_storage().data_ptr() for p in trainer.model.parameters()}
    by_maker = {}
    for ptr, (n_bytes, maker) in storages.items():
        if ptr not in parameters:
            by_maker[maker] = by_maker.get(maker, 0.0) + n_bytes / 2 ** 20
    return by_maker


def step_ratio_line(name, ours, theirs):
    """fairseq's time over ``name``'s for the same steps: in all, and the median per step."""
    return (f"{THEIRS} / {name}: {sum(theirs) / sum(ours):.3f}x in all ({sum(theirs):.3f} s / "
            f"{sum(ours):.3f} s), median of the per-step ratios "
            f"{statistics.median(b / a for a, b in zip(ours, theirs)):.3f}x")


def print_profiles(trainers, samples, device=CPU, rows=25):
    """torch.profiler on training steps of each trainer, alternated step by step as above: the
    operators with the most time (self time, summed over the steps: the CPU's, or on a GPU the
    GPU's) and the time and FLOPs of the matrix products (aten::mm, aten::addmm)."""
    from torch.profiler import profile

    totals = {name: {} for name in trainers}
    for i, sample in enumerate(samples):
        for name in alternated(list(trainers), i):
            with profile(activities=profiler_activities(device), with_flops=True) as prof:
                trainers[name].train_step([sample])
            add_profile(totals[name], prof, device)
    for name, ops in totals.items():
        print_profile(f"{name}, {len(samples)} steps profiled", ops, device, rows)


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


def print_profile(title, ops, device=CPU, rows=25):
    """The operators of ``add_profile`` with the most self time, and the matrix products."""
    on_gpu = device.kind == "cuda"
    gemm = [ops.get(key, [0.0] * 5) for key in ("aten::mm", "aten::addmm")]
    print(f"\n{title}: {sum(t[0] for t in ops.values()):.2f} s of {'GPU' if on_gpu else 'CPU'} "
          "time" + (f" ({sum(t[3] for t in ops.values()):.2f} s of CPU time)" if on_gpu else "")
          + f", matrix products {sum(t[0] for t in gemm):.2f} s, "
          f"{sum(t[2] for t in gemm) / 1e9:,.1f} GFLOP")
    for key, (seconds, calls, *_) in sorted(ops.items(), key=lambda kv: -kv[1][0])[:rows]:
        print(f"  {seconds:8.3f} s {calls:7d} calls  {key}")
    if on_gpu:  # small steps wait on the host: where its time goes (nested operators overlap)
        print("  by the CPU's time, with what each calls:")
        for key, (_, calls, _, _, host) in sorted(ops.items(), key=lambda kv: -kv[1][4])[:rows]:
            print(f"  {host:8.3f} s {calls:7d} calls  {key}")


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

    from fairseq_plugin.testing.operations import STEP_CALLS, around_step_calls

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
    for name in alternated(list(setups), rounds):
        with profile(activities=profiler_activities(device), with_flops=True) as prof:
            decode(name, lambda call: record_function(f"model.{call}"))  # rows of their own
        ops = {}
        add_profile(ops, prof, device)
        calls = {call: ops.pop(f"model.{call}", [0.0] * 5)[4] for _, call in STEP_CALLS}
        print_profile(f"{name}, beam 5, {n_sentences} sentences x {length} tokens, profiled",
                      ops, device, rows)
        print("  (CPU time in the model's calls: " + ", ".join(
            f"{call} {seconds:.3f} s" for call, seconds in calls.items()) + ")")
    return {name: (statistics.median(whole), statistics.median(model))
            for name, (whole, model) in spent.items()}


def self_gpu_time(event) -> float:
    """A profiler event's own time on the GPU, in microseconds (renamed in torch 2.4)."""
    if hasattr(event, "self_device_time_total"):
        return event.self_device_time_total
    return event.self_cuda_time_total


def generate_run(data_bin, checkpoint, length, max_tokens, user_dir, sentences, device=CPU):
    """fairseq-generate --beam 5 on the test set of ``data_bin``, which has ``sentences``
    sentences (checked against what fairseq-generate reports): (tokens/s, peak MB)."""
    out, rss = run_measured([
        fairseq_cli("fairseq-generate"), data_bin, "--user-dir", user_dir,
        "--path", checkpoint, "--beam", "5", "--min-len", length, "--max-len-a", "0",
        "--max-len-b", length, "--max-tokens", max_tokens, "--required-batch-size-multiple", "1",
        *device.flags()], device)
    if device.precision == "bf16" and BF16_MODELS not in out:
        raise SystemExit("benchmark: error: fairseq-generate did not decode in bf16")
    for line in out.splitlines():
        if "Translated" in line and "tokens/s" in line:
            translated = int(line.split("Translated ")[1].split(" sentences")[0].replace(",", ""))
            if translated != sentences:
                raise SystemExit(f"benchmark: error: fairseq-generate translated {translated} "
                                 f"sentences, not the {sentences} of {data_bin}'s test set")
            return float(line.split("sentences/s, ")[1].split(" tokens/s")[0]), rss
    raise SystemExit("benchmark: error: fairseq-generate printed no speed")


def ctranslate2_run(data_bin, checkpoint, length, max_tokens, work):
    """Export the checkpoint to CTranslate2 and decode the test set with beam 5, every hypothesis
    forced to ``length`` tokens + EOS as in generate_run, in a child process (so this one stays
    small: a child's peak memory counts its parent's at fork). Returns (tokens/s, tokens per
    hypothesis, peak MB)."""
    out, rss = run_measured([sys.executable, os.path.abspath(__file__), "--ctranslate2-worker",
                             json.dumps([data_bin, checkpoint, length, max_tokens, work])])
    result = json.loads(out.strip().splitlines()[-1])
    return result["tps"], result["per_hyp"], rss


def ctranslate2_worker(data_bin, checkpoint, length, max_tokens, work):
    import ctranslate2
    import torch
    from fairseq.data import Dictionary, data_utils

    from fairseq_plugin.export import export

    ct2_dir = os.path.join(work, "ctranslate2")
    export(checkpoint, os.path.join(work, "transformer.pt"), data_bin, ct2_dir, force=True,
           log=lambda *_: None)
    src, tgt = data_utils.infer_language_pair(data_bin)
    dictionary = Dictionary.load(os.path.join(data_bin, f"dict.{src}.txt"))
    dataset = data_utils.load_indexed_dataset(os.path.join(data_bin, f"test.{src}-{tgt}.{src}"),
                                              dictionary)
    sources = [dictionary.string(dataset[i][:-1]).split() for i in range(len(dataset))]
    translator = ctranslate2.Translator(ct2_dir, device="cpu",
                                        intra_threads=torch.get_num_threads())
    start = time.perf_counter()
    results = translator.translate_batch(sources, beam_size=5, max_batch_size=max_tokens,
                                         batch_type="tokens", min_decoding_length=length,
                                         max_decoding_length=length)
    seconds = time.perf_counter() - start
    tokens = sum(len(r.hypotheses[0]) + 1 for r in results)  # + EOS, as fairseq counts
    print(json.dumps({"tps": tokens / seconds, "per_hyp": tokens / len(results)}))


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


def ratio_row(label, name, ours, theirs):
    """A table row: the medians, the median of the per-round ratios and the ratios."""
    ratios = [a / b for a, b in zip(ours, theirs)]
    return (f"| {label} | {name} | {statistics.median(ours):.0f} | {statistics.median(theirs):.0f}"
            f" | {statistics.median(ratios):.2f}x | {' '.join(f'{x:.2f}' for x in ratios)} |")


def positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number of at least 1")
    return value


def lengths_list(text: str):
    """An argparse type: comma-separated target lengths, e.g. 25,50,100."""
    try:
        return [positive_int(x) for x in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give target lengths of at least 1, separated by commas, e.g. 25,50,100")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
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
    p.add_argument("--max-tokens", type=positive_int, default=4096)
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
                        "(scripts/cuda_peak.py)")
    p.add_argument("--precision", choices=["fp32", "fp16", "bf16"], default=None,
                   help="fairseq's --fp16 or --bf16, or fp32 (default: fp32 on cpu, fp16 on "
                        "cuda); bf16 with fairseq's --tpu switched back off, and fairseq-generate's "
                        "models turned to bf16 as they load (scripts/fairseq_bf16.py)")
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
    p.add_argument("--also-torch-choice", action="store_true",
                   help="also run annotated_transformer with --fused-attention-backends torch in "
                        "every round (A B C, C B A, ...): its fused attention on the backend torch "
                        "chooses, which may be cuDNN on a GPU, instead of the default no-cudnn")
    p.add_argument("--also-without-packing", action="store_true",
                   help="also run annotated_transformer with --no-packing in every round: in "
                        "training, its position-wise work on every position, padding included")
    p.add_argument("--ctranslate2-worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if ((args.profile_steps or args.without_packing or args.gpu_paths_on_cpu)
            and args.steps_in_process is None):
        p.error("--profile-steps, --without-packing and --gpu-paths-on-cpu go with "
                "--steps-in-process N")
    if args.profile_steps and args.profile_steps > args.steps_in_process:
        p.error(f"--profile-steps {args.profile_steps}: at most the {args.steps_in_process} steps "
                f"of --steps-in-process")
    if args.skip_generation and args.decoding_in_process:
        p.error("--skip-generation --decoding-in-process: the second decodes; leave out one")
    if args.ctranslate2_worker:
        return ctranslate2_worker(*json.loads(args.ctranslate2_worker))

    import torch

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
        import fairseq_bf16
        fairseq_bf16.switch_on()
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
    if args.steps_in_process:
        seconds = steps_in_process(data_bin, args.preset, args.max_tokens, args.steps_in_process,
                                   args.profile_steps, device, args.without_packing,
                                   gpu_paths=args.gpu_paths_on_cpu)
        ours, theirs = seconds[OURS], seconds[THEIRS]
        print(f"\n{len(ours)} training steps each, alternated: {OURS} median "
              f"{1000 * statistics.median(ours):.0f} ms, {THEIRS} median "
              f"{1000 * statistics.median(theirs):.0f} ms; {step_ratio_line(OURS, ours, theirs)}")
        if args.without_packing:
            unpacked = seconds[NO_PACKING]
            print(f"{NO_PACKING}: median {1000 * statistics.median(unpacked):.0f} ms; "
                  f"{step_ratio_line(NO_PACKING, unpacked, theirs)}")
        return
    # contestants: (name, --arch, --user-dir, more model flags); --before adds another checkout's
    # plugin, --also-torch-choice ours with --fused-attention-backends torch,
    # --also-without-packing ours with --no-packing
    contestants = [(OURS, OURS, plugin_dir(), []), (THEIRS, THEIRS, plugin_dir(), [])]
    if args.before:
        contestants.append((BEFORE, OURS, os.path.abspath(args.before), []))
    if args.also_torch_choice:
        contestants.append((OURS_TORCH_CHOICE, OURS, plugin_dir(),
                            ["--fused-attention-backends", "torch"]))
    if args.also_without_packing:
        contestants.append((NO_PACKING, OURS, plugin_dir(), ["--no-packing"]))
    results = {name: {"train_wps": [], "later_wps": [], "train_mb": [], "gen_tps": [],
                      "gen_mb": []}
               for name, _, _, _ in contestants}
    ct2_tps, ct2_mb = [], []
    complete = 0  # rounds
    signal.signal(signal.SIGTERM, raise_stopped)
    try:
        for r in range(args.rounds):
            for name, arch, user_dir, flags in alternated(contestants, r):
                save = os.path.join(work, f"{folder_name(name)}-round{r}")
                started = time.perf_counter()
                wps, later_wps, mb, peak_where = train_run(
                    data_bin, arch, args.preset, save, args.train_updates, args.max_tokens,
                    user_dir, device, flags)
                trained = time.perf_counter()
                res = results[name]
                res["train_wps"].append(wps)
                res["later_wps"].append(later_wps)
                res["train_mb"].append(mb)
                generated = ""
                if not args.skip_generation:
                    tps, gen_mb = generate_run(gen_bin, os.path.join(save, "checkpoint_last.pt"),
                                               args.gen_length, args.max_tokens, user_dir,
                                               n_decoded, device)
                    res["gen_tps"].append(tps)
                    res["gen_mb"].append(gen_mb)
                    generated = (f"beam-5 {tps:7.1f} tok/s {gen_mb:6.0f} MB   (the commands "
                                 f"took {trained - started:.0f} s and "
                                 f"{time.perf_counter() - trained:.0f} s)")
                print(f"  round {r + 1} {name:30s} train {wps:8.0f} wps {mb:6.0f} MB   "
                      + (generated or f"(the command took {trained - started:.0f} s)")
                      + (f"\n          training peak {peak_where}" if peak_where else "")
                      + (f"\n          after the first epoch {later_wps:.0f} wps"
                         if later_wps is not None
                         else "\n          (no logged interval after the first epoch)"),
                      flush=True)
                if name == OURS and not args.skip_ctranslate2:
                    ct2, per_hyp, mb = ctranslate2_run(
                        gen_bin, os.path.join(save, "checkpoint_last.pt"), args.gen_length,
                        args.max_tokens, save)
                    ct2_tps.append(ct2)
                    ct2_mb.append(mb)
                    print(f"  round {r + 1} {'(exported) CTranslate2':30s} beam-5 {ct2:7.1f} "
                          f"tok/s {mb:6.0f} MB ({per_hyp:.0f} tokens per hypothesis, export "
                          "included in MB)", flush=True)
            complete = r + 1
    except Stopped:
        print(f"\nbenchmark: stopped (SIGTERM) in round {complete + 1} of {args.rounds}; the "
              f"tables give the {complete} complete rounds", flush=True)
        if complete == 0:
            raise SystemExit("benchmark: error: stopped before the first round was complete")
        for figures in [*results.values(), {"ct2_tps": ct2_tps, "ct2_mb": ct2_mb}]:
            for values in figures.values():
                del values[complete:]
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    # each contestant against fairseq's transformer: the ratio of each round's runs, then their
    # median (the machine's speed drifts between rounds more than between the runs of a round)
    theirs = results[THEIRS]
    print(f"\n| medians of {complete} rounds | model | the model | transformer | "
          "median of the per-round ratios | per-round ratios |")
    print("|---|---|---|---|---|---|")
    table = [("train_wps", "training, target words/s"),
             ("later_wps", "training after the first epoch, target words/s"),
             ("gen_tps", "generation beam 5, tokens/s"),
             ("train_mb", "training peak memory, MB"),
             ("gen_mb", "generation peak memory, MB")]
    later_in_every_run = all(None not in res["later_wps"] for res in results.values())
    for key, label in table:
        if key == "later_wps" and not later_in_every_run:
            continue  # said under the table
        if key.startswith("gen_") and args.skip_generation:
            continue
        for name in results:
            if name != THEIRS:
                print(ratio_row(label, name, results[name][key], theirs[key]))
    if ct2_tps:
        print(ratio_row("generation beam 5, tokens/s", "annotated_transformer exported to "
                        "CTranslate2", ct2_tps, theirs["gen_tps"]))
    if not later_in_every_run:
        print("\n(no row for training after the first epoch: not every training command logged "
              "an interval after its first epoch; raise --train-updates for it)")
    if ABORTED_AFTER_FINISHING:
        print(f"\n{len(ABORTED_AFTER_FINISHING)} commands finished and then aborted in Python's "
              f"shutdown, their figures kept (notes above): {', '.join(ABORTED_AFTER_FINISHING)}")
    if complete < args.rounds:
        raise SystemExit(f"benchmark: stopped after {complete} of {args.rounds} rounds (SIGTERM); "
                         "the table above gives those")

    if not args.skip_cache:
        lengths = args.cache_lengths
        checkpoint = os.path.join(work, "annotated_transformer-round0", "checkpoint_last.pt")
        rows = cache_speedups(checkpoint, data_bin, lengths, device=device)
        print("\n| annotated_transformer decoding 20 sentences | target tokens | cached, s | "
              "cached, written-out attention, s | recomputing the prefix, s | speed-up |")
        print("|---|---|---|---|---|---|")
        for beam, length, cached, other, recomputed in rows:
            name = "greedy" if beam == 1 else f"beam {beam}"
            print(f"| {name} | {length} | {cached:.3f} | {other:.3f} | {recomputed:.3f} | "
                  f"{recomputed / cached:.1f}x |")

        # what sets the pace of small decoding steps on a GPU: launches and reads to the host
        from fairseq_plugin.modules.attention import EXPLICIT
        checkpoints = {name: os.path.join(work, f"{name}-round0", "checkpoint_last.pt")
                       for name in (OURS, THEIRS)}
        columns = {OURS: (checkpoints[OURS], None),
                   f"{OURS}, written-out attention": (checkpoints[OURS], EXPLICIT),
                   THEIRS: (checkpoints[THEIRS], None)}
        ops = step_operations(columns, data_bin, args.gen_length, device=device)
        print(f"\n| per beam-5 decoder step, 20 sentences, {args.gen_length} tokens, "
              f"{device.kind} | {' | '.join(columns)} |\n|---|---|---|---|")
        for key, label in (("launches", "operations that launch work"),
                           ("reads", "reads back to the host")):
            print(f"| {label} | {' | '.join(f'{ops[c][key]:.1f}' for c in columns)} |")

    if args.decoding_in_process:
        names = (OURS, THEIRS) + ((OURS_TORCH_CHOICE,) if args.also_torch_choice else ())
        checkpoints = {name: os.path.join(work, f"{folder_name(name)}-round0",
                                          "checkpoint_last.pt") for name in names}
        spent = decoding_in_process(checkpoints, data_bin, args.gen_length, device=device)
        print(f"\n| beam 5 in this process, 100 sentences x {args.gen_length} tokens, "
              f"{device.kind}, medians of 3 alternated | decoding, s | in the model's per-step "
              "calls, s | the rest (encoder, SequenceGenerator), s |\n|---|---|---|---|")
        for name, (whole, in_model) in spent.items():
            print(f"| {name} | {whole:.3f} | {in_model:.3f} | {whole - in_model:.3f} |")
        for name in names[:1] + names[2:]:
            print(f"{THEIRS} / {name}: {spent[THEIRS][0] / spent[name][0]:.2f}x in decoding, "
                  f"{spent[THEIRS][1] / spent[name][1]:.2f}x in the model's calls")


if __name__ == "__main__":
    main()
