"""annotated-benchmark-learning: does annotated_transformer learn as well as fairseq's transformer?

The learning counterpart of ``annotated-benchmark`` (speed). For each synthetic task (copy,
reverse, sort: cli/reverse_task.py writes them) it trains both architectures with one command
line in which only ``--arch`` differs, over several seeds, and prints, per task and model, the
mean ± standard deviation over seeds of

- exact match on the test set (fairseq-generate, beam 5, checkpoint_best.pt),
- the best epoch's validation NLL (fairseq's ``nll_loss``, bits per target token),
- training time (fairseq's "done training in ... seconds").

Single runs of a small task swing by about ±0.05 exact match from seed to seed, so only means over
seeds compare. The two models of a seed train one after the other, their order alternating from
seed to seed (a machine's drift then favours neither). Everything is written under --work-dir:
each run's logs, checkpoints and translations, and results.json (every run's figures).
docs/benchmarks.md ("Learning") shows the table and the command.
"""

import argparse
import json
import os
import re
import shlex
import statistics
import time
from typing import Callable, Dict, List, NamedTuple, Sequence, Tuple

from . import reverse_task
from .common import fairseq_cli, plugin_dir, run
from ..errors import PluginError, command

ARCHS = ("annotated_transformer", "transformer")

# every flag both architectures get: the notebook's pre-LN layers, 2 + 2 of d_model 128
# (fairseq's transformer is post-LN unless told); fairseq's own criterion, optimiser, schedule
MODEL_FLAGS = [
    "--encoder-layers", "2", "--decoder-layers", "2",
    "--encoder-embed-dim", "128", "--decoder-embed-dim", "128",
    "--encoder-ffn-embed-dim", "512", "--decoder-ffn-embed-dim", "512",
    "--encoder-attention-heads", "4", "--decoder-attention-heads", "4",
    "--encoder-normalize-before", "--decoder-normalize-before",
    "--dropout", "0.1", "--attention-dropout", "0.0", "--activation-dropout", "0.0",
    "--share-all-embeddings",
]
TRAINING_FLAGS = [
    "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
    "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--adam-eps", "1e-9",
    "--lr", "0.002", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "200",
    "--max-tokens", "4096", "--no-epoch-checkpoints", "--no-last-checkpoints",
    "--cpu", "--log-format", "simple",
]

VALID_NLL = re.compile(r"valid on 'valid' subset \|.*?\| nll_loss ([0-9.]+)")
TRAINING_TIME = re.compile(r"done training in ([0-9.]+) seconds")


def train_command(arch: str, data_bin: str, save_dir: str, epochs: int, seed: int,
                  extra: Sequence[str] = ()) -> List[str]:
    """fairseq-train for one run: the same for both architectures but for ``--arch``
    (``extra``: more flags, for both)."""
    return [fairseq_cli("fairseq-train"), data_bin, "--user-dir", plugin_dir(), "--arch", arch,
            *MODEL_FLAGS, *TRAINING_FLAGS, "--max-epoch", str(epochs), "--seed", str(seed),
            "--save-dir", save_dir, *extra]


def order(seed: int) -> Tuple[str, ...]:
    """The two models in the order a seed trains them: alternating from seed to seed, so that a
    machine's drift favours neither."""
    return ARCHS if seed % 2 else ARCHS[::-1]


def training_figures(log_path: str) -> Dict[str, float]:
    """The best validation NLL and the training time in a fairseq-train log."""
    with open(log_path) as f:
        text = f.read()
    nll = [float(x) for x in VALID_NLL.findall(text)]
    seconds = TRAINING_TIME.findall(text)
    if not nll or not seconds:
        raise PluginError(f"{log_path} has no validation line or no 'done training' line: "
                          f"did fairseq-train finish? (see the log)")
    return {"valid_nll": min(nll), "train_seconds": float(seconds[-1])}


def mean_sd(values: List[float], digits: int = 3) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.{digits}f} ± {sd:.{digits}f}"


def table(results: List[dict], tasks, archs=ARCHS) -> str:
    """One row per task and model: means ± standard deviations over seeds."""
    lines = ["| task | model | seeds | exact match | valid NLL (bits) | training (s) |",
             "|---|---|---|---|---|---|"]
    for task in tasks:
        for arch in archs:
            runs = [r for r in results if r["task"] == task and r["arch"] == arch]
            if not runs:
                continue
            lines.append(f"| {task} | {arch} | {len(runs)} | "
                         f"{mean_sd([r['exact_match'] for r in runs])} | "
                         f"{mean_sd([r['valid_nll'] for r in runs])} | "
                         f"{mean_sd([r['train_seconds'] for r in runs], 0)} |")
    return "\n".join(lines)


def prepare_task(task: str, work_dir: str, train_size: int, quiet) -> str:
    """The task's data (one data seed for every run) through fairseq-preprocess: its data-bin."""
    raw, data_bin = os.path.join(work_dir, task, "raw"), os.path.join(work_dir, task, "data-bin")
    if os.path.exists(os.path.join(data_bin, "dict.src.txt")):
        return data_bin  # made by an earlier run of this command with the same --work-dir
    reverse_task.main([raw, "--train", str(train_size)], task=task)
    run([fairseq_cli("fairseq-preprocess"), "--source-lang", "src", "--target-lang", "tgt",
         "--trainpref", f"{raw}/train", "--validpref", f"{raw}/valid", "--testpref", f"{raw}/test",
         "--destdir", data_bin, "--joined-dictionary", "--workers", "2"],
        os.path.join(work_dir, task, "preprocess.log"), echo=quiet)
    return data_bin


class Runs(NamedTuple):
    """What every run shares: where runs go, how long they train, the flags added to each
    training command, and where their commands' output is echoed."""
    work_dir: str
    epochs: int
    extra: Sequence[str]
    echo: Callable


def one_run(task: str, arch: str, seed: int, data_bin: str, runs: Runs) -> dict:
    """One training and decoding of ``arch`` on ``task`` with ``seed``, in a folder of its own;
    its figures."""
    out = os.path.join(runs.work_dir, task, f"{arch}-seed{seed}")
    if os.path.exists(out):
        raise PluginError(f"{out} exists (an earlier run's); give a new --work-dir or delete it")
    os.makedirs(out)
    log = os.path.join(out, "train.log")
    command = train_command(arch, data_bin, os.path.join(out, "checkpoints"), runs.epochs, seed,
                            runs.extra)
    with open(os.path.join(out, "command.txt"), "w") as f:
        f.write(shlex.join(command) + "\n")
    run(command, log, echo=runs.echo)
    generated = os.path.join(out, "generate.txt")
    run(reverse_task.generate_command(data_bin, os.path.join(out, "checkpoints",
                                                             "checkpoint_best.pt")),
        os.path.join(out, "generate.log"), output_path=generated, echo=runs.echo)
    match = reverse_task.exact_match(reverse_task.read_generate_output(generated))
    return {"task": task, "arch": arch, "seed": seed, "exact_match": match,
            **training_figures(log)}


@command("annotated-benchmark-learning", "run it again with a new --work-dir")
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work-dir", default="work/learning", help="data, runs and results.json")
    p.add_argument("--tasks", nargs="+", choices=sorted(reverse_task.TASKS),
                   default=["copy", "reverse", "sort"])
    p.add_argument("--seeds", type=int, default=4, help="seeds 1..N for each model (default 4)")
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--train-size", type=int, default=10000, help="training pairs per task")
    p.add_argument("--flags", default="", help="more fairseq-train flags for both models, one "
                   "string (an ablation: e.g. '--encoder-learned-pos --decoder-learned-pos')")
    args = p.parse_args(argv)
    for flag, value in (("--seeds", args.seeds), ("--epochs", args.epochs),
                        ("--train-size", args.train_size)):
        if value < 1:
            p.error(f"{flag} {value}: give at least 1")
    extra = shlex.split(args.flags)
    work_dir = os.path.abspath(args.work_dir)
    os.makedirs(work_dir, exist_ok=True)
    quiet = lambda *a, **k: None  # noqa: E731 (each run's command and log are in its folder)
    runs = Runs(work_dir, args.epochs, extra, quiet)
    print(f"{len(args.tasks)} tasks x {len(ARCHS)} models x {args.seeds} seeds, {args.epochs} "
          f"epochs of {args.train_size} pairs; the command line of a run (only --arch differs):\n"
          f"  {shlex.join(train_command('ARCH', 'DATA', 'SAVE', args.epochs, 1, extra)[1:])}",
          flush=True)
    results, started = [], time.monotonic()
    for task in args.tasks:
        data_bin = prepare_task(task, work_dir, args.train_size, quiet)
        for seed in range(1, args.seeds + 1):
            for arch in order(seed):
                r = one_run(task, arch, seed, data_bin, runs)
                results.append(r)
                print(f"  {task:8} {arch:22} seed {seed}: exact match {r['exact_match']:.3f}, "
                      f"valid NLL {r['valid_nll']:.3f}, {r['train_seconds']:.0f} s", flush=True)
                with open(os.path.join(work_dir, "results.json"), "w") as f:
                    json.dump(results, f, indent=1)
    print(table(results, args.tasks))
    print(f"({time.monotonic() - started:.0f} s in all; every run's figures in "
          f"{os.path.join(work_dir, 'results.json')})")


if __name__ == "__main__":
    main()
