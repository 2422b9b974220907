#!/usr/bin/env python
"""A synthetic task end to end through fairseq's own CLIs: "learn to reverse a sequence", or
(--task copy) the notebook's first example, copying one.

generate data -> fairseq-preprocess -> fairseq-train (annotated_transformer_tiny,
annotated_label_smoothing, noam) -> fairseq-generate (reverse: beam 5; copy: greedy, as the
notebook decodes it) -> exact-match accuracy.
Every command is printed before it runs; full logs go to WORK_DIR/*.log.
"""

import argparse
import os
import shutil
import time

from fairseq_plugin.cli import reverse_task
from fairseq_plugin.cli.common import fairseq_cli, fairseq_validation, run
from fairseq_plugin.errors import PluginError, stops_in_one_line

MARKER = ".reverse-demo"  # in WORK_DIR: an earlier run of this demo made what is there
# per task: epochs, training pairs and beam size by default
DEFAULTS = {"reverse": dict(epochs=30, train_size=20000, beam=5),
            "copy": dict(epochs=10, train_size=10000, beam=1)}


def fresh_work_dir(work_dir):
    """Start afresh: an earlier run's outputs (WORK_DIR holds the marker) are replaced, as
    fairseq-preprocess refuses existing dictionaries and fairseq-train would resume its
    checkpoint; any other non-empty WORK_DIR is refused."""
    if os.path.exists(work_dir) and not os.path.isdir(work_dir):
        raise PluginError(f"--work-dir {work_dir} is a file; give a directory")
    if os.path.isdir(work_dir) and os.listdir(work_dir):
        if not os.path.exists(os.path.join(work_dir, MARKER)):
            raise PluginError(f"{work_dir} is not empty and no earlier run of this demo made it; "
                              f"choose another --work-dir (or delete it)")
        print(f"(starting afresh: replacing the earlier run's outputs in {work_dir})", flush=True)
        shutil.rmtree(work_dir)
    os.makedirs(work_dir, exist_ok=True)
    open(os.path.join(work_dir, MARKER), "w").close()


@stops_in_one_line("reverse_demo", "run it again: it starts over in its --work-dir")
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", choices=sorted(DEFAULTS), default="reverse")
    p.add_argument("--work-dir", help="where data, checkpoints, logs go (default: work/TASK)")
    p.add_argument("--epochs", type=int)
    p.add_argument("--train-size", type=int)
    p.add_argument("--beam", type=int, help="1: greedy decoding")
    p.add_argument("--examples", type=int, default=5, help="examples to print")
    args = p.parse_args(argv)
    for name, value in DEFAULTS[args.task].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.work_dir = args.work_dir or os.path.join("work", args.task)
    for flag, value in (("--epochs", args.epochs), ("--train-size", args.train_size),
                        ("--beam", args.beam)):
        if value < 1:
            p.error(f"{flag} {value}: give at least 1")

    w = os.path.abspath(args.work_dir)
    raw, data_bin, ckpt = (os.path.join(w, d) for d in ("raw", "data-bin", "checkpoints"))
    fresh_work_dir(w)  # a PluginError is printed in one line (fairseq_plugin.errors)
    start = time.time()

    print(f"[1/4] generating the {args.task} task in {raw}", flush=True)
    reverse_task.main([raw, "--train", str(args.train_size)], task=args.task)

    print("[2/4] fairseq-preprocess", flush=True)
    run([fairseq_cli("fairseq-preprocess"), "--source-lang", "src", "--target-lang", "tgt",
         "--trainpref", f"{raw}/train", "--validpref", f"{raw}/valid", "--testpref", f"{raw}/test",
         "--destdir", data_bin, "--joined-dictionary", "--workers", "2"],
        os.path.join(w, "preprocess.log"))

    print(f"[3/4] fairseq-train, {args.epochs} epochs", flush=True)
    run(reverse_task.train_command(data_bin, ckpt, args.epochs), os.path.join(w, "train.log"),
        show=fairseq_validation, epochs=args.epochs)

    print(f"[4/4] fairseq-generate --beam {args.beam} (checkpoint_best.pt)", flush=True)
    gen_out = os.path.join(w, "generate.txt")
    # the epoch of the lowest validation loss, as fairseq's users decode: exact match swings
    # from epoch to epoch
    run(reverse_task.generate_command(data_bin, os.path.join(ckpt, "checkpoint_best.pt"),
                                      beam=args.beam), gen_out)

    triples = reverse_task.read_generate_output(gen_out)
    for i in sorted(triples)[: args.examples]:
        s, r, h = triples[i]
        print(f"  source     {s}\n  reference  {r}\n  hypothesis {h}  {'ok' if r == h else 'WRONG'}")
    print(f"exact match: {reverse_task.exact_match(triples):.1%} of {len(triples)} test sequences "
          f"({'greedy' if args.beam == 1 else f'beam {args.beam}'}; "
          f"{time.time() - start:.0f} s in all)")


if __name__ == "__main__":
    main()
