"""Runs through fairseq's own commands, as a user runs them: fairseq-train's target words/s
(from its json log) and fairseq-generate's tokens/s, each command's peak memory; and the
exported model decoded by CTranslate2."""

import json
import os
import signal
import statistics
import subprocess
import sys
import time

from fairseq_plugin.cli.common import fairseq_cli

from . import cli_process
from .common import BF16_MODELS, CPU, training_flags


ABORTED_AFTER_FINISHING = []  # the commands that did (names), for the summary


def report_abort_after_finishing(name: str, out: str) -> None:
    """A command that finished its work and then aborted in Python's shutdown (cli_process.py):
    its figures stand; say so, with the Python threads alive when its script had finished and
    what faulthandler printed of its threads at the abort."""
    ABORTED_AFTER_FINISHING.append(name)
    alive = [line for line in out.splitlines() if line.startswith(cli_process.THREADS_ALIVE)]
    dump = out[out.find("Fatal Python error"):] if "Fatal Python error" in out else ""
    print(f"  note: {name} finished (exit status 0), then aborted in Python's shutdown (SIGABRT); "
          "its figures are kept (fairseq_plugin/benchmark/cli_process.py)"
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
    out, rss = run_measured([sys.executable, "-m", "fairseq_plugin.benchmark", "--ctranslate2-worker",
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
