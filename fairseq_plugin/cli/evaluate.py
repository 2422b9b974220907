"""Beam search on a prepared test set and detokenised sacreBLEU against the raw references.

fairseq-generate (--beam N, BPE removed and Moses-detokenised by fairseq's own subword_nmt and
moses post-processing) -> hypotheses in corpus order -> sacreBLEU's corpus BLEU and chrF against
DATA_BIN/raw/test.TGT, each printed with its signature, after a few source / reference /
hypothesis triples.

  annotated-evaluate-bleu DATA_BIN CHECKPOINT [--beam 5] [--lenpen 1.0] [--subset test|valid]
                   [--examples 5] [--output hyps.txt]

Choose --lenpen on --subset valid, then report test with it.
"""

import argparse
import functools
import os
import sys

from ..outputs import check_output_file
from ..errors import PluginError, command
from .common import check_checkpoint, fairseq_cli, plugin_dir, prepared_settings, run


def generate_detokenised(data_bin, checkpoint, beam=5, max_tokens=4096, subset="test",
                         extra=(), echo=print):
    """Run fairseq-generate, echoing a progress line per batch; return {sentence id:
    detokenised hypothesis}. Its output and log go next to the checkpoint
    (generate-SUBSET.txt, generate-SUBSET.log), replacing earlier ones only once it succeeds."""
    settings = prepared_settings(data_bin)
    check_checkpoint(checkpoint)
    cmd = [fairseq_cli("fairseq-generate"), data_bin,
           "--user-dir", plugin_dir(), "--path", checkpoint, "--gen-subset", subset,
           "--source-lang", settings["source_lang"], "--target-lang", settings["target_lang"],
           "--beam", str(beam), "--max-tokens", str(max_tokens),
           # fairseq drops a last batch that is not a multiple of 8 (fairseq issue #5036)
           "--required-batch-size-multiple", "1",
           "--tokenizer", "moses", "--bpe", "subword_nmt",
           "--bpe-codes", os.path.join(data_bin, settings["bpe_codes"]),
           "--log-format", "simple", "--log-interval", "1", *extra]
    stem = os.path.join(os.path.dirname(os.path.abspath(checkpoint)), f"generate-{subset}")
    # a failed run leaves its log as .new.log (named in the error) and the earlier outputs intact
    run(cmd, stem + ".new.log", output_path=stem + ".new.txt", echo=echo)
    for suffix in (".log", ".txt"):
        os.replace(stem + ".new" + suffix, stem + suffix)
    hyps = {}
    with open(stem + ".txt", encoding="utf-8") as f:
        lines = f.read().splitlines()
    for line in lines:
        if line.startswith("D-"):
            idx, _score, text = line.split("\t", 2)
            hyps[int(idx[2:])] = text
    return hyps, settings


def score(data_bin, hyps, settings, subset="test"):
    import sacrebleu

    def lines(lang):
        with open(os.path.join(data_bin, "raw", f"{subset}.{lang}"), encoding="utf-8") as f:
            return [line.rstrip("\n") for line in f]

    sources, refs = lines(settings["source_lang"]), lines(settings["target_lang"])
    if len(hyps) != len(refs):
        raise PluginError(f"{len(hyps)} hypotheses for {len(refs)} references in "
                          f"{data_bin}/raw/{subset}.{settings['target_lang']}: the data-bin's "
                          f"binarised and raw {subset} sets differ; prepare it again")
    ordered = [hyps[i] for i in range(len(refs))]
    from ..tasks.annotated_translation import chrf_metric  # validation's --eval-chrf too

    scores = []  # (score, its signature) for BLEU, then chrF
    for metric in (sacrebleu.metrics.BLEU(), chrf_metric()):
        scores.append((metric.corpus_score(ordered, [refs]), metric.get_signature()))
    return scores, list(zip(sources, refs, ordered))


@command("annotated-evaluate-bleu", "earlier outputs are kept")
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("data_bin")
    p.add_argument("checkpoint")
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--lenpen", type=float, default=1.0,
                   help="fairseq-generate's length penalty (> 1 favours longer output)")
    p.add_argument("--max-len-a", type=float, default=0,
                   help="fairseq-generate's: hypotheses of at most a * source length + b tokens")
    p.add_argument("--max-len-b", type=int, default=200, help="(fairseq-generate's)")
    p.add_argument("--subset", choices=("test", "valid"), default="test")
    p.add_argument("--examples", type=int, default=5)
    p.add_argument("--output", help="write the detokenised hypotheses here")
    args = p.parse_args(argv)
    if args.output:  # before the whole test set is decoded; a text file, overwritten
        check_output_file(args.output, force=True, example="hypotheses.txt",
                          inputs=[args.checkpoint], folders=[args.data_bin])
    hyps, settings = generate_detokenised(args.data_bin, args.checkpoint, args.beam,
                                          subset=args.subset,
                                          extra=["--lenpen", str(args.lenpen),
                                                 "--max-len-a", str(args.max_len_a),
                                                 "--max-len-b", str(args.max_len_b)],
                                          echo=functools.partial(print, file=sys.stderr))
    scores, triples = score(args.data_bin, hyps, settings, args.subset)
    if args.output:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output, "w", encoding="utf-8") as f:
            f.writelines(h + "\n" for _, _, h in triples)
    for src, ref, hyp in triples[: args.examples]:
        print(f"  source     {src}\n  reference  {ref}\n  hypothesis {hyp}\n")
    for result, signature in scores:
        print(f"{result}  ({args.subset}, beam {args.beam}, lenpen {args.lenpen:g}, "
              f"{len(triples)} sentences)\nsignature: {signature}")


if __name__ == "__main__":
    main()
