"""annotated-benchmark-deployment: what deploying with CTranslate2 gains or loses against fairseq.

One checkpoint and its data-bin (annotated-prepare's: it keeps the raw references). The test set
is translated with beam search by three engines:

- fairseq: the checkpoint in fairseq's SequenceGenerator, built as fairseq-generate builds it
  (``task.build_generator`` with --beam and --lenpen),
- CTranslate2 fp32 and CTranslate2 int8: the checkpoint exported by ``annotated-export-fairseq
  --ctranslate2`` and loaded with ``compute_type`` float32 or int8,

on the same sentences in the same batches (sorted by source length, --batch-size sentences each).
Each run is a fresh process, timed warm: loading is not timed and one batch is translated before
the clock starts. For each engine it prints detokenised sacreBLEU BLEU and chrF against the raw
references (with their signatures), sentences per second for each --threads count (the median of
--rounds runs, the order of the runs reversed in every other round) and the peak memory: the most
the process's resident memory grew from just before the model was loaded (model, engine,
decoding; Linux), the largest over its runs. --work-dir keeps the export and each engine's
detokenised hypotheses (ENGINE.test.LANG). docs/export.md shows the table and the command.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

from ..errors import PluginError, command
from .common import PACKAGE_DIR, check_checkpoint, prepared_settings
from .evaluate import score

ENGINES = ("fairseq", "CTranslate2 fp32", "CTranslate2 int8")
COMPUTE_TYPES = {"CTranslate2 fp32": "float32", "CTranslate2 int8": "int8"}
MAX_LENGTH = 200  # fairseq-generate's default --max-len-b (with --max-len-a 0), for both engines


def resident_mb(field: str) -> float:
    """This process's resident memory from /proc/self/status: VmRSS (now) or VmHWM (its peak)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024  # kB
    raise PluginError(f"/proc/self/status has no {field}")


def fairseq_translator(checkpoint, data_bin, threads, beam, lenpen):
    """A function from a batch of BPE'd sentences (token lists) to their best hypotheses, by the
    generator fairseq-generate builds."""
    import torch
    from fairseq import checkpoint_utils
    from fairseq.data import data_utils

    torch.set_num_threads(threads)
    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task(
        [checkpoint], arg_overrides={"data": data_bin})
    for model in models:
        model.prepare_for_inference_(cfg)
    generator = task.build_generator(
        models, argparse.Namespace(beam=beam, lenpen=lenpen, max_len_a=0, max_len_b=MAX_LENGTH))
    source, target = task.source_dictionary, task.target_dictionary

    def translate(batch):
        tokens = [source.encode_line(" ".join(s), add_if_not_exist=False) for s in batch]  # + EOS
        sample = {"net_input": {
            "src_tokens": data_utils.collate_tokens(tokens, source.pad(), left_pad=True),
            "src_lengths": torch.tensor([len(t) for t in tokens])}}
        with torch.inference_mode():
            hypotheses = generator.generate(models, sample)
        return [target.string(h[0]["tokens"]).split() for h in hypotheses]

    return translate


def ctranslate2_translator(model_dir, compute_type, threads, beam, lenpen):
    """The same function for a CTranslate2 model (which appends EOS itself)."""
    import ctranslate2

    translator = ctranslate2.Translator(model_dir, device="cpu", compute_type=compute_type,
                                        intra_threads=threads, inter_threads=1)

    def translate(batch):
        results = translator.translate_batch(batch, beam_size=beam, length_penalty=lenpen,
                                             max_decoding_length=MAX_LENGTH)
        return [r.hypotheses[0] for r in results]

    return translate


def decode(job: dict):
    """One run, in a child process: load the engine, translate the first batch untimed, then all
    batches timed; writes {"seconds", "hypotheses", "memory_mb"} to ``job["output"]``. ``job``
    (run_child's): engine, batches, threads, beam, lenpen, checkpoint, data_bin, ct2_dir."""
    before = resident_mb("VmRSS")
    engine, batches, threads = job["engine"], job["batches"], job["threads"]
    if engine == "fairseq":
        translate = fairseq_translator(job["checkpoint"], job["data_bin"], threads, job["beam"],
                                       job["lenpen"])
    else:
        translate = ctranslate2_translator(job["ct2_dir"], COMPUTE_TYPES[engine], threads,
                                           job["beam"], job["lenpen"])
    translate(batches[0])  # warm-up
    start = time.perf_counter()
    hypotheses = [h for batch in batches for h in translate(batch)]
    seconds = time.perf_counter() - start
    with open(job["output"], "w") as f:
        json.dump({"seconds": seconds, "hypotheses": hypotheses,
                   "memory_mb": resident_mb("VmHWM") - before}, f)


def run_child(work, engine, threads, **kwargs):
    """``decode`` in a fresh Python with ``threads`` threads, importing this very package (run
    in ``work``, with the package's folder first on its path); its figures."""
    output = os.path.join(work, "run.json")
    path = os.pathsep.join(filter(None, [os.path.dirname(PACKAGE_DIR),
                                         os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "PYTHONPATH": path}
    code = ("import json, sys; from fairseq_plugin.cli.deployment import decode; "
            "decode(json.loads(sys.argv[1]))")
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps({"engine": engine, "threads": threads,
                                                 "output": output, **kwargs})],
        capture_output=True, text=True, env=env, cwd=work)
    if proc.returncode != 0:
        raise PluginError(f"the {engine} run with {threads} threads failed:\n{proc.stderr[-3000:]}")
    with open(output) as f:
        return json.load(f)


def test_batches(data_bin, settings, batch_size):
    """The test set's BPE'd source sentences (token lists) sorted by length, in batches of
    ``batch_size``, and the sentence index of each position."""
    from fairseq.data import Dictionary, data_utils

    src, tgt = settings["source_lang"], settings["target_lang"]
    dictionary = Dictionary.load(os.path.join(data_bin, f"dict.{src}.txt"))
    dataset = data_utils.load_indexed_dataset(os.path.join(data_bin, f"test.{src}-{tgt}.{src}"),
                                              dictionary)
    if dataset is None:
        raise PluginError(f"{data_bin} has no binarised test set (test.{src}-{tgt}.{src})")
    sentences = [dictionary.string(dataset[i][:-1]).split() for i in range(len(dataset))]
    order = sorted(range(len(sentences)), key=lambda i: (len(sentences[i]), i))
    ordered = [sentences[i] for i in order]
    return [ordered[i:i + batch_size] for i in range(0, len(ordered), batch_size)], order


def detokenise(tokens, lang):
    """BPE removed and Moses-detokenised, as fairseq-generate's subword_nmt and moses do."""
    from sacremoses import MosesDetokenizer

    return MosesDetokenizer(lang=lang).detokenize((" ".join(tokens) + " ").replace("@@ ", "")
                                                  .split())


def whole_numbers(text):
    """An argparse type: whole numbers of at least 1, separated by commas."""
    try:
        numbers = [int(x) for x in text.split(",")]
    except ValueError:
        numbers = [0]
    if min(numbers) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give whole numbers of at least 1, separated "
                                         "by commas, e.g. 1,2")
    return numbers


def positive(text):
    """An argparse type: one whole number of at least 1."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number of at least 1")
    return int(text)


def cpu_name():
    """The CPU's model name (Linux), else the machine's architecture."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def parser():
    p = argparse.ArgumentParser(prog="annotated-benchmark-deployment",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("data_bin", help="annotated-prepare's data-bin (binarised test set, raw/)")
    p.add_argument("checkpoint", help="an annotated_transformer checkpoint")
    p.add_argument("--threads", type=whole_numbers, default=[1, 2],
                   help="thread counts, comma-separated: a column of sentences/s each")
    p.add_argument("--batch-size", type=positive, default=32, help="sentences per batch")
    p.add_argument("--beam", type=positive, default=5)
    p.add_argument("--lenpen", type=float, default=1.0, help="length penalty, both engines")
    p.add_argument("--rounds", type=positive, default=3)
    p.add_argument("--work-dir", help="keep the export and each run's output here (default: a "
                                      "temp dir)")
    return p


@command("annotated-benchmark-deployment")
def main(argv=None):
    args = parser().parse_args(argv)
    settings = prepared_settings(args.data_bin)
    check_checkpoint(args.checkpoint)
    with tempfile.TemporaryDirectory() as temp:
        measure(args, settings, args.work_dir or temp)


def measure(args, settings, work):
    from ..export import export

    work, checkpoint, data_bin = map(os.path.abspath, (work, args.checkpoint, args.data_bin))
    os.makedirs(work, exist_ok=True)
    ct2_dir = os.path.join(work, "ctranslate2")
    export(checkpoint, os.path.join(work, "transformer.pt"), data_bin, ct2_dir, force=True)
    batches, order = test_batches(data_bin, settings, args.batch_size)
    n = len(order)
    runs = [(engine, t) for t in args.threads for engine in ENGINES]
    speeds = {run: [] for run in runs}
    memory = {engine: 0.0 for engine in ENGINES}
    hypotheses = {}
    print(f"{n} test sentences in batches of {args.batch_size}, beam {args.beam}, lenpen "
          f"{args.lenpen:g}; {args.rounds} rounds", flush=True)
    for r in range(args.rounds):
        for engine, threads in runs if r % 2 == 0 else runs[::-1]:
            result = run_child(work, engine, threads, batches=batches, beam=args.beam,
                               lenpen=args.lenpen, checkpoint=checkpoint, data_bin=data_bin,
                               ct2_dir=ct2_dir)
            speeds[engine, threads].append(n / result["seconds"])
            memory[engine] = max(memory[engine], result["memory_mb"])
            hypotheses.setdefault(engine, result["hypotheses"])
            print(f"  round {r + 1} {engine}, {threads} threads: {n / result['seconds']:.1f} "
                  f"sentences/s, {result['memory_mb']:.0f} MB", flush=True)
    print_table(args, settings, speeds, memory, hypotheses, order, work)


def print_table(args, settings, speeds, memory, hypotheses, order, work):
    import ctranslate2
    import torch

    tgt = settings["target_lang"]
    threads = " | ".join(f"sentences/s, {t} thread{'s' if t > 1 else ''}" for t in args.threads)
    print(f"\n| engine | BLEU | chrF | {threads} | peak memory, MB |")
    print("|---|---|---|" + "---|" * len(args.threads) + "---|")
    signatures = []
    for engine in ENGINES:
        by_sentence = {i: detokenise(h, tgt) for i, h in zip(order, hypotheses[engine])}
        with open(os.path.join(work, engine.replace(" ", "-") + f".test.{tgt}"), "w",
                  encoding="utf-8") as f:  # in the test set's order
            f.writelines(by_sentence[i] + "\n" for i in range(len(order)))
        scores, _ = score(args.data_bin, by_sentence, settings)
        (bleu, _), (chrf, _) = scores
        signatures = [s for _, s in scores]
        cells = " | ".join(f"{statistics.median(speeds[engine, t]):.1f}" for t in args.threads)
        print(f"| {engine} | {bleu.score:.2f} | {chrf.score:.2f} | {cells} | "
              f"{memory[engine]:.0f} |")
    print(f"\nmedians of {args.rounds} rounds; {len(order)} test sentences, batches of "
          f"{args.batch_size} sentences, beam {args.beam}, lenpen {args.lenpen:g}; "
          f"{cpu_name()}, torch {torch.__version__}, "
          f"ctranslate2 {ctranslate2.__version__}")
    for signature in signatures:
        print(f"signature: {signature}")


if __name__ == "__main__":
    main()
