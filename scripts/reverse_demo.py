#!/usr/bin/env python
"""The reverse task end to end through fairseq's own CLIs (the seed: "learn to reverse a sequence").

generate data -> fairseq-preprocess -> fairseq-train (annotated_transformer_tiny,
annotated_label_smoothing, noam) -> fairseq-generate --beam 5 -> exact-match accuracy.
Every command is printed before it runs; full logs go to WORK_DIR/*.log.
"""

import argparse
import os
import time

import reverse_data
from _common import fairseq_cli, plugin_dir, run


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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work-dir", default="work/reverse", help="where data, checkpoints, logs go")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--train-size", type=int, default=20000)
    p.add_argument("--examples", type=int, default=5, help="examples to print")
    args = p.parse_args(argv)

    w = os.path.abspath(args.work_dir)
    raw, data_bin, ckpt = (os.path.join(w, d) for d in ("raw", "data-bin", "checkpoints"))
    os.makedirs(w, exist_ok=True)
    start = time.time()

    print(f"[1/4] generating the reverse task in {raw}", flush=True)
    reverse_data.main([raw, "--train", str(args.train_size)])

    print("[2/4] fairseq-preprocess", flush=True)
    run([fairseq_cli("fairseq-preprocess"), "--source-lang", "src", "--target-lang", "tgt",
         "--trainpref", f"{raw}/train", "--validpref", f"{raw}/valid", "--testpref", f"{raw}/test",
         "--destdir", data_bin, "--joined-dictionary", "--workers", "2"],
        os.path.join(w, "preprocess.log"))

    print(f"[3/4] fairseq-train, {args.epochs} epochs", flush=True)
    run(train_command(data_bin, ckpt, args.epochs), os.path.join(w, "train.log"),
        echo_if="valid on 'valid' subset")

    print("[4/4] fairseq-generate --beam 5", flush=True)
    gen_out = os.path.join(w, "generate.txt")
    run(generate_command(data_bin, os.path.join(ckpt, "checkpoint_last.pt")), gen_out)

    triples = read_generate_output(gen_out)
    for i in sorted(triples)[: args.examples]:
        s, r, h = triples[i]
        print(f"  source     {s}\n  reference  {r}\n  hypothesis {h}  {'ok' if r == h else 'WRONG'}")
    print(f"exact match: {exact_match(triples):.1%} of {len(triples)} test sequences "
          f"(beam 5; {time.time() - start:.0f} s in all)")


if __name__ == "__main__":
    main()
