#!/usr/bin/env python
"""The main job: German -> English translation on the bundled Tatoeba sample, end to end.

prepare (sacremoses + joint BPE + fairseq-preprocess) -> fairseq-train (annotated_transformer,
CPU-sized, label smoothing, Noam) -> fairseq-generate --beam 5 (BPE removed, detokenised) ->
sacreBLEU's BLEU and chrF, each with its signature, after a few source / reference / hypothesis
triples.
Every command is printed; full logs go to WORK_DIR/*.log.
"""

import argparse
import os
import shutil
import time

from fairseq_plugin.cli import evaluate as evaluate_bleu
from fairseq_plugin.cli import prepare as prepare_translation
from fairseq_plugin.cli.common import (fairseq_cli, fairseq_validation, plugin_dir,
                                       prepared_settings, run)
from fairseq_plugin.errors import PluginError, stops_in_one_line

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Sized for about 10 minutes of training on 2 CPU cores (the README gives its result and time).
MODEL = ["--arch", "annotated_transformer", "--encoder-layers", "3", "--decoder-layers", "3",
         "--encoder-embed-dim", "128", "--encoder-ffn-embed-dim", "512",
         "--encoder-attention-heads", "4", "--decoder-attention-heads", "4",
         "--share-all-embeddings", "--dropout", "0.1"]
TRAINING = ["--criterion", "annotated_label_smoothing", "--label-smoothing", "0.1",
            "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--adam-eps", "1e-9",
            "--lr-scheduler", "noam", "--warmup-updates", "300", "--noam-factor", "1",
            "--max-tokens", "4096"]
BPE_MERGES = 6000
BUNDLED_PAIRS = {"train": 60000, "valid": 1000, "test": 1000}  # examples/tatoeba/data


MARKER = ".translation-demo"  # in WORK_DIR: the demo made what is there, also half-way


def check_work_dir(work_dir):
    """The demo replaces WORK_DIR/data-bin and WORK_DIR/checkpoints only where an earlier run of
    it made the folder: WORK_DIR is new or empty, holds the demo's marker, or its data-bin is the
    demo's finished preparation (its languages, merges and numbers of pairs)."""
    if os.path.exists(work_dir) and not os.path.isdir(work_dir):
        raise PluginError(f"--work-dir {work_dir} is a file; give a directory")
    if not os.path.isdir(work_dir) or not os.listdir(work_dir):
        return
    if os.path.exists(os.path.join(work_dir, MARKER)):
        return
    data_bin = os.path.join(work_dir, "data-bin")
    try:
        settings = prepared_settings(data_bin)
        ours = (settings.get("source_lang"), settings.get("target_lang"),
                settings.get("bpe_merges"), settings.get("splits")) == (
            "de", "en", BPE_MERGES, BUNDLED_PAIRS)
    except (PluginError, ValueError):
        ours = False
    if not ours:
        raise PluginError(f"{work_dir} is not empty and no earlier run of this demo made it (the "
                          f"demo replaces its data-bin and checkpoints); choose another --work-dir")


@stops_in_one_line("translation_demo", "run it again: it starts over in its --work-dir")
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work-dir", default="work/tatoeba")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--examples", type=int, default=6)
    args = p.parse_args(argv)
    if args.epochs < 1:
        p.error(f"--epochs {args.epochs}: train at least 1 epoch")

    w = os.path.abspath(args.work_dir)
    data_bin, ckpt = os.path.join(w, "data-bin"), os.path.join(w, "checkpoints")
    check_work_dir(w)  # a PluginError is printed in one line (fairseq_plugin.errors)
    os.makedirs(w, exist_ok=True)
    open(os.path.join(w, MARKER), "w").close()
    start = time.time()

    print(f"[1/3] preparing the bundled Tatoeba sample ({BPE_MERGES} joint BPE merges)", flush=True)
    prepare_translation.prepare(prepare_translation.Preparation(
        os.path.join(REPO, "examples", "tatoeba", "data"), data_bin, "de", "en",
        bpe_merges=BPE_MERGES, force=True))

    print(f"[2/3] fairseq-train, {args.epochs} epochs", flush=True)
    if os.path.isdir(ckpt):  # fairseq-train would resume an earlier run's checkpoint_last.pt
        print(f"  (starting afresh: replacing the earlier run's {ckpt})", flush=True)
        shutil.rmtree(ckpt)
    run([fairseq_cli("fairseq-train"), data_bin, "--user-dir", plugin_dir(), *MODEL, *TRAINING,
         "--max-epoch", args.epochs, "--seed", "1", "--save-dir", ckpt, "--no-epoch-checkpoints",
         "--cpu", "--log-format", "simple", "--log-interval", "20"],
        os.path.join(w, "train.log"), show=fairseq_validation, epochs=args.epochs)
    trained = time.time()

    print("[3/3] fairseq-generate --beam 5, detokenised sacreBLEU and chrF on the 1,000 test "
          "sentences", flush=True)
    hyps, settings = evaluate_bleu.generate_detokenised(data_bin,
                                                        os.path.join(ckpt, "checkpoint_last.pt"))
    scores, triples = evaluate_bleu.score(data_bin, hyps, settings)
    with open(os.path.join(w, "hypotheses.en"), "w", encoding="utf-8") as f:
        f.writelines(h + "\n" for _, _, h in triples)
    for src, ref, hyp in triples[: args.examples]:
        print(f"  source     {src}\n  reference  {ref}\n  hypothesis {hyp}\n")
    for result, signature in scores:  # BLEU, then chrF
        print(f"{result}\nsignature: {signature}")
    print(f"training {trained - start:.0f} s, in all {time.time() - start:.0f} s; "
          f"outputs in {w}")


if __name__ == "__main__":
    main()
