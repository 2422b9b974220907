"""Synthetic sanity tasks: the notebook's first example, copying a sequence of symbols, "learn to
reverse a sequence", and sorting one (annotated-benchmark-learning's third task).

``annotated-copy-data OUT_DIR`` and ``annotated-reverse-data OUT_DIR`` write
{train,valid,test}.{src,tgt}, one space-separated sequence per line; the target is the source
copied, or reversed. Symbols are drawn uniformly from a small alphabet, so the only way to do
well is to learn the task itself. The copy task's defaults are the notebook's: sequences of 10
symbols from a vocabulary of 10. The fairseq-train and fairseq-generate commands used by
scripts/reverse_demo.py and the tests are here too.
"""

import argparse
import os
import random

from .common import fairseq_cli, plugin_dir

ALPHABET = [chr(c) for c in range(ord("a"), ord("z") + 1)]
# the target of each task, from the source; and the task's defaults (length, alphabet size)
TASKS = {"reverse": (lambda seq: seq[::-1], dict(min_len=3, max_len=12, vocab=20)),
         "copy": (lambda seq: seq, dict(min_len=10, max_len=10, vocab=10)),
         "sort": (sorted, dict(min_len=3, max_len=12, vocab=20))}


def write_split(path_prefix: str, count: int, rng: random.Random, min_len: int, max_len: int,
                vocab: int, task: str = "reverse") -> None:
    target_of = TASKS[task][0]
    with open(path_prefix + ".src", "w") as src, open(path_prefix + ".tgt", "w") as tgt:
        for _ in range(count):
            seq = [rng.choice(ALPHABET[:vocab]) for _ in range(rng.randint(min_len, max_len))]
            src.write(" ".join(seq) + "\n")
            tgt.write(" ".join(target_of(seq)) + "\n")


def read_generate_output(path):
    """fairseq-generate output -> {id: (source, reference, hypothesis)}."""
    src, ref, hyp = {}, {}, {}
    with open(path) as f:
        for line in f:
            fields = line.rstrip("\n").split("\t")
            kind, _, idx = fields[0].partition("-")
            if not idx.isdigit():
                continue
            if kind == "S":
                src[int(idx)] = fields[1]
            elif kind == "T":
                ref[int(idx)] = fields[1]
            elif kind == "H":
                hyp[int(idx)] = fields[2]
    return {i: (src.get(i, ""), ref[i], hyp.get(i, "")) for i in ref}


def exact_match(triples) -> float:
    return sum(r == h for _, r, h in triples.values()) / max(len(triples), 1)


def train_command(data_bin, save_dir, epochs, seed=1, extra=()):
    return [
        fairseq_cli("fairseq-train"), data_bin, "--user-dir", plugin_dir(),
        "--arch", "annotated_transformer_tiny", "--share-all-embeddings",
        "--criterion", "annotated_label_smoothing", "--label-smoothing", "0.1",
        "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--adam-eps", "1e-9",
        "--lr-scheduler", "noam", "--warmup-updates", "200",
        "--max-tokens", "4096", "--max-epoch", str(epochs), "--seed", str(seed),
        "--save-dir", save_dir, "--no-epoch-checkpoints", "--cpu", "--log-format", "simple",
        *extra,
    ]


def generate_command(data_bin, checkpoint, beam=5):
    # --required-batch-size-multiple 1: fairseq otherwise drops the last test sentences when
    # their number is not a multiple of 8 (fairseq issue #5036)
    return [fairseq_cli("fairseq-generate"), data_bin, "--user-dir", plugin_dir(), "--path", checkpoint,
            "--beam", str(beam), "--max-tokens", "4096", "--required-batch-size-multiple", "1",
            "--cpu"]


def main(argv=None, task="reverse"):
    defaults = TASKS[task][1]
    p = argparse.ArgumentParser(description=f"Write the {task} task's data.")
    p.add_argument("out_dir")
    p.add_argument("--train", type=int, default=20000, help="training pairs")
    p.add_argument("--valid", type=int, default=500)
    p.add_argument("--test", type=int, default=500)
    p.add_argument("--min-len", type=int, default=defaults["min_len"])
    p.add_argument("--max-len", type=int, default=defaults["max_len"])
    p.add_argument("--vocab", type=int, default=defaults["vocab"],
                   help=f"alphabet size (at most {len(ALPHABET)})")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    if not 1 <= args.vocab <= len(ALPHABET):
        p.error(f"--vocab must be between 1 and {len(ALPHABET)}")
    if not 1 <= args.min_len <= args.max_len:
        p.error("need 1 <= --min-len <= --max-len")
    for split in ("train", "valid", "test"):
        if getattr(args, split) < 1:
            p.error(f"--{split} {getattr(args, split)}: give at least 1 pair")
    if os.path.exists(args.out_dir) and not os.path.isdir(args.out_dir):
        p.error(f"{args.out_dir} is a file; give a directory for the data")
    os.makedirs(args.out_dir, exist_ok=True)
    rng = random.Random(args.seed)
    for split in ("train", "valid", "test"):
        write_split(os.path.join(args.out_dir, split), getattr(args, split), rng, args.min_len,
                    args.max_len, args.vocab, task)


def copy_main(argv=None):
    """annotated-copy-data: the notebook's copy task."""
    main(argv, task="copy")


if __name__ == "__main__":
    main()
