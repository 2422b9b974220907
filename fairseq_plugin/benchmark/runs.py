"""Runs through fairseq's own commands, as a user runs them: fairseq-train's target words/s (from
its json log) and fairseq-generate's tokens/s, each with its peak memory; and the exported model
decoded by CTranslate2."""

import json
import os
import statistics
import sys
import time

from fairseq_plugin.cli.common import fairseq_cli

from .bf16 import MODELS_IN_BF16
from .child import Device, run_measured
from .common import training_flags


def train_run(data_bin, contestant, preset, save_dir, updates, max_tokens, device=Device()):
    """fairseq-train for ``updates`` updates: (target words/s, the same after the first epoch or
    None, peak MB, on a GPU when the peak came)."""
    out, mb, where = run_measured([
        fairseq_cli("fairseq-train"),
        *training_flags(data_bin, contestant, preset, max_tokens, device),
        # one checkpoint, at the end, without the optimizer's state (decoding needs no more)
        "--max-update", updates, "--save-dir", save_dir, "--no-epoch-checkpoints",
        "--save-interval", "1000000", "--no-save-optimizer-state", "--disable-validation",
        "--log-format", "json", "--log-interval", "5"], device)
    return (*training_speeds(out), mb, where)


def training_speeds(out: str):
    """From fairseq-train's json log: the median target words/s of its intervals but the first,
    and of those after the first epoch but the first of them (None where there are none): the
    pace of a long run, once every batch shape has been seen (cuDNN's plans made)."""
    logged = [json.loads(line[line.index("{"):])
              for line in out.splitlines() if "train_inner" in line and "{" in line]
    if len(logged) < 2:
        raise SystemExit("benchmark: error: too few logged intervals; raise --train-updates")
    later = [float(stats["wps"]) for stats in logged if int(stats["epoch"]) > 1][1:]
    return (statistics.median(float(stats["wps"]) for stats in logged[1:]),
            statistics.median(later) if later else None)


def generate_run(data_bin, checkpoint, length, max_tokens, user_dir, sentences, device=Device()):
    """fairseq-generate --beam 5 on the test set of ``data_bin`` (``sentences`` of them, checked
    against what it reports), every hypothesis forced to ``length`` tokens: (tokens/s, peak MB)."""
    out, mb, _ = run_measured([
        fairseq_cli("fairseq-generate"), data_bin, "--user-dir", user_dir,
        "--path", checkpoint, "--beam", "5", "--min-len", length, "--max-len-a", "0",
        "--max-len-b", length, "--max-tokens", max_tokens, "--required-batch-size-multiple", "1",
        *device.flags()], device)
    if device.precision == "bf16" and MODELS_IN_BF16 not in out:
        raise SystemExit("benchmark: error: fairseq-generate did not decode in bf16")
    for line in out.splitlines():
        if "Translated" in line and "tokens/s" in line:
            translated = int(line.split("Translated ")[1].split(" sentences")[0].replace(",", ""))
            if translated != sentences:
                raise SystemExit(f"benchmark: error: fairseq-generate translated {translated} "
                                 f"sentences, not the {sentences} of {data_bin}'s test set")
            return float(line.split("sentences/s, ")[1].split(" tokens/s")[0]), mb
    raise SystemExit("benchmark: error: fairseq-generate printed no speed")


def ctranslate2_run(data_bin, checkpoint, length, max_tokens, work):
    """The checkpoint exported to CTranslate2 and the test set decoded with beam 5, forced to
    ``length`` tokens as in generate_run, in a child process (a child's peak counts its parent's
    at fork): (tokens/s, tokens per hypothesis, peak MB, export included)."""
    out, mb, _ = run_measured([
        sys.executable, "-c", "import sys, json; from fairseq_plugin.benchmark.runs import "
        "ctranslate2_decode; ctranslate2_decode(*json.loads(sys.argv[1]))",
        json.dumps([data_bin, checkpoint, length, max_tokens, work])])
    result = json.loads(out.strip().splitlines()[-1])
    return result["tps"], result["per_hyp"], mb


def ctranslate2_decode(data_bin, checkpoint, length, max_tokens, work):
    """ctranslate2_run's child: prints {"tps", "per_hyp"}."""
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
