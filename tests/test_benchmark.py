"""annotated-benchmark (fairseq_plugin.benchmark) runs end to end on a tiny job, and its ratios are
its own figures'."""

import gc
import importlib.util
import os
import re
import statistics
import subprocess
import sys

import pytest
import torch

from conftest import FAIRSEQ_BREAKS_POST_LN, REPO, preprocess_reverse, reverse_data_bin

from fairseq_plugin.benchmark import (common, cuda_peak, data, memory, mfu, profiling, report,
                                      runs, steps, storage_peak)

BENCHMARK = [sys.executable, "-m", "fairseq_plugin.benchmark"]  # annotated-benchmark


def load_script(name):
    """scripts/NAME.py as a module."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "scripts", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# the CPU's step peak (storage_peak) watches storages' Python objects: torch 2.1.2's do not live
# as long as their storages
needs_watchable_storages = pytest.mark.skipif(
    not storage_peak.storages_keep_their_python_object(), reason=storage_peak.UNSUPPORTED)

TINY = ["--data", "synthetic", "--train-sentences", "400", "--test-sentences", "16",
        "--preset", "tiny", "--max-tokens", "1024"]


def benchmark(*args, work):
    proc = subprocess.run([*BENCHMARK, *TINY, "--work-dir", str(work), *args],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout



@pytest.mark.main_lane  # for CI's time; the 0.12.2 lane keeps in-process steps and MFU
def test_gpu_paths_on_cpu_give_our_model_torchs_dropout_and_a_gpus_rows_without_keys(
        tmp_path, monkeypatch):
    """--gpu-paths-on-cpu: in --steps-in-process our model takes on the CPU the paths it takes
    on a GPU (torch's dropout, not the CPU mask; attention's W^O bias for queries with no key,
    where a GPU's kernel is not certain to zero them), so that what it keeps for backward is as
    there, and the process's setting is restored after."""
    from fairseq_plugin.modules import attention, dropout

    data_bin = reverse_data_bin(tmp_path / "data", "--train", 400, "--valid", 20, "--test", 10)
    calls = {"cpu mask": 0, "rows without keys handled": 0}
    cpu_dropout, attend = dropout._CpuDropout.apply, attention.attend

    def counted(name, function, counts=lambda result: True):
        def wrapper(*args, **kwargs):
            result = function(*args, **kwargs)
            calls[name] += counts(result)
            return result
        return wrapper

    monkeypatch.setattr(dropout._CpuDropout, "apply", counted("cpu mask", cpu_dropout))
    monkeypatch.setattr(attention, "attend", counted(
        "rows without keys handled", attend, lambda result: result[2] is not None))
    zeroes = attention.fused_kernel_zeroes_empty_rows
    steps.steps_in_process(str(data_bin), "tiny", 1024, 2, gpu_paths=True)
    assert calls["cpu mask"] == 0
    assert calls["rows without keys handled"] > 0  # the reverse task's sources are padded
    assert attention.fused_kernel_zeroes_empty_rows is zeroes
    calls.update({name: 0 for name in calls})
    steps.steps_in_process(str(data_bin), "tiny", 1024, 2)  # the CPU's own paths
    assert calls["cpu mask"] > 0
    if zeroes(torch.zeros(1)):  # torch >= 2.5: the CPU's kernel zeroes such rows itself
        assert calls["rows without keys handled"] == 0
    proc = subprocess.run([*BENCHMARK, "--device", "cuda", "--steps-in-process",
                           "2", "--gpu-paths-on-cpu"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-1] == ("annotated-benchmark: error: --gpu-paths-on-cpu: on a GPU "
                                            "the model takes them anyway; leave it out there")

@pytest.mark.skipif(FAIRSEQ_BREAKS_POST_LN, reason="fairseq 0.12.2's own transformer (post-LN) "
                    "cannot decode padded batches (fairseq #4858): the benchmark's generation "
                    "needs fairseq-fixed")
def test_the_benchmark_prints_each_ratio_from_the_figures_beside_it_and_the_cache_table(tmp_path):
    # a test set of 40, of which the first 16 are decoded (the benchmark checks fairseq-generate's
    # count of translated sentences)
    data_bin = reverse_data_bin(tmp_path / "data", "--train", 400, "--valid", 50, "--test", 40)
    out = benchmark("--data-bin", str(data_bin), "--rounds", "1", "--train-updates", "20",
                    "--gen-length", "8", "--cache-lengths", "4", "--skip-ctranslate2",
                    "--decoding-in-process", "--also-torch-choice", work=tmp_path / "work")
    assert re.search(r"training batches: [\d.]+% source and [\d.]+% target positions are padding",
                     out)
    assert "decoding the first 16 of 40 test sentences" in out
    # each run's line, with its commands' times (what a GPU session's plan is sized by)
    assert len(re.findall(r"(?m)^  round 1 (?:annotated_transformer(?: torch-choice)?|"
                          r"transformer) +train .* MB   \(the commands took \d+ s and \d+ s\)$",
                          out)) == 3, out
    rows = {}
    for line in out.splitlines():  # | label | model | ours | theirs | ratio | per-round ratios |
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 6 and cells[1] == "annotated_transformer":
            rows[cells[0]] = (float(cells[2]), float(cells[3]), float(cells[4].rstrip("x")),
                              [float(r) for r in cells[5].split()])
    # 20 updates logged every 5 of 400 sentences: intervals after the first epoch in every run
    assert sorted(rows) == sorted(["training, target words/s",
                                   "training after the first epoch, target words/s",
                                   "generation beam 5, tokens/s", "training peak memory, MB",
                                   "generation peak memory, MB"])
    assert len(re.findall(r"(?m)^          after the first epoch \d+ wps, [\d.]+ TFLOP/s, "
                          r"[\d.]+% MFU$", out)) == 3, out[:3000]
    assert len(re.findall(r"\n\| [^|]+ \| annotated_transformer torch-choice \| [\d.]+ \|",
                          out)) == 5
    for ours, theirs, ratio, per_round in rows.values():
        assert ours > 0 and theirs > 0 and len(per_round) == 1
        # one round: the median of the ratios is that round's ratio of the figures beside it
        # the figures beside it are printed rounded to units, the ratio to hundredths
        low, high = (ours - 0.5) / (theirs + 0.5), (ours + 0.5) / (theirs - 0.5)
        assert low - 0.005 <= ratio <= high + 0.005
        assert abs(ratio - statistics.median(per_round)) <= 0.0051
    cache = [line for line in out.splitlines() if re.match(r"\| (greedy|beam 5) \| 4 \|", line)]
    assert len(cache) == 2 and all(line.rstrip().endswith("x |") for line in cache)
    # cached, cached with the other attention kernel, recomputed: seconds
    assert all(float(c) > 0 for line in cache for c in line.strip("| \n").split("|")[2:5])
    # per beam-5 step: launches and host reads of each model, counted
    ops = {line.split("|")[1].strip(): [float(c) for c in line.strip("| \n").split("|")[1:]]
           for line in out.splitlines()
           if re.match(r"\| (operations that launch work|reads back to the host) \|", line)}
    assert len(ops) == 2 and all(n > 0 for row in ops.values() for n in row), out[-2000:]
    # beam 5 in this process: seconds in all and in the model's per-step calls, and the rest
    spent = {cells[0]: [float(c) for c in cells[1:]] for cells in (
        [c.strip() for c in line.strip("| \n").split("|")] for line in out.splitlines()
        if re.match(r"\| (annotated_transformer( torch-choice)?|transformer) \| [\d.]+ \|", line))}
    assert sorted(spent) == ["annotated_transformer", "annotated_transformer torch-choice",
                             "transformer"], out[-2000:]
    for name in ("annotated_transformer", "annotated_transformer torch-choice"):
        assert re.search(rf"\ntransformer / {name}: [\d.]+x in decoding, [\d.]+x in the "
                         r"model's calls\n", out), name
    for whole, in_model, rest in spent.values():
        assert 0 < in_model < whole and abs(whole - in_model - rest) <= 0.0015
    profiled = re.findall(r"\n(annotated_transformer(?: torch-choice)?|transformer), beam 5, 100 "
                          r"sentences x 8 "
                          r"tokens, profiled: [\d.]+ s of CPU time in [\d.]+ s of wall time, "
                          r".*\n(?:  .*\n)+  \(CPU time "
                          r"in the model's calls: forward ([\d.]+) s", out)
    assert sorted(name for name, _ in profiled) == ["annotated_transformer",
                                                    "annotated_transformer torch-choice",
                                                    "transformer"]
    assert all(float(seconds) > 0 for _, seconds in profiled)
    # where each decoding's time goes: a column per model, the parts adding up to the whole
    table = out[out.index("\n| beam 5, 100 sentences x 8 tokens, one profiled decoding, CPU "
                          "time, s | annotated_transformer | transformer | annotated_transformer "
                          "torch-choice |\n|---|---|---|---|\n"):].split("\n")[3:9]
    parts = {row.split(" | ")[0].lstrip("| "): [float(c) for c in row.strip("| ").split(" | ")[1:]]
             for row in table}
    assert list(parts) == ["matrix products of the model's passes (mm, addmm)",
                           "attention's kernels (fused; or bmm, softmax)",
                           "the rest of the model's passes", "reordering for beam search",
                           "SequenceGenerator's own, log-probabilities included",
                           "the profiled decoding"], table
    *each, whole = parts.values()
    for model in range(3):
        assert whole[model] > 0 and abs(sum(row[model] for row in each) - whole[model]) <= 0.003
        assert parts["matrix products of the model's passes (mm, addmm)"][model] > 0


def check_step_ratio(out, name):
    m = re.search(rf"transformer / {name}: ([\d.]+)x in all \(([\d.]+) s / ([\d.]+) s\)", out)
    assert m, out[-2000:]
    ratio, theirs, ours = float(m[1]), float(m[2]), float(m[3])  # sums printed to 1 ms
    low, high = (theirs - 0.0005) / (ours + 0.0005), (theirs + 0.0005) / (ours - 0.0005)
    assert low - 0.0005 <= ratio <= high + 0.0005


def test_steps_in_process_time_the_models_and_profile_their_matrix_products(tmp_path):
    out = benchmark("--steps-in-process", "2", "--profile-steps", "1", "--without-packing",
                    work=tmp_path)
    assert "2 training steps each, alternated: annotated_transformer median" in out, out[-2000:]
    check_step_ratio(out, "annotated_transformer")
    check_step_ratio(out, "annotated_transformer without packing")
    gflop = {}
    for name in ("annotated_transformer", "transformer", "annotated_transformer without packing"):
        profiled = re.search(rf"\n{name}, 1 steps profiled: [\d.]+ s of CPU time in [\d.]+ s of "
                             r"wall time, matrix products [\d.]+ s, ([\d,.]+) GFLOP", out)
        assert profiled, name
        gflop[name] = float(profiled[1].replace(",", ""))
    # the same batch: computing the padding (about a fifth of the target positions here) costs
    # matrix products that packing saves
    assert 0 < gflop["annotated_transformer"] < gflop["annotated_transformer without packing"]
    # and the activations kept for backward, with the ratio of the figures beside it
    kept = re.search(r"\nkept for backward by one training forward of the timed batch with "
                     r"the most target padding \([\d.]+% target padding, \d+ positions\) "
                     r"\(distinct storages, parameters excluded\): annotated_transformer "
                     r"([\d.]+) MiB, transformer ([\d.]+) MiB, annotated_transformer without "
                     r"packing ([\d.]+) MiB; annotated_transformer / transformer: ([\d.]+)x\n",
                     out)
    assert kept, out[-2000:]
    ours, theirs, unpacked, ratio = map(float, kept.groups())
    assert ours > 0 and theirs > 0 and unpacked > 0
    assert abs(ratio - ours / theirs) <= 0.006
    # then by the operators that made it, and the same for the batch with the most positions
    assert "\n| made by (grad_fn, dtype) | annotated_transformer, MiB | transformer, MiB |\n" in out
    assert ("\nkept for backward by one training forward of the timed batch with the most "
            "positions (") in out
    if not storage_peak.storages_keep_their_python_object():
        assert f"\n(no step peaks on the CPU: {storage_peak.UNSUPPORTED})\n" in out
        assert "held at its peak" not in out
        return
    # on the CPU what one step holds at its peak is counted by storage (storage_peak): at least
    # what the forward keeps for backward, less the gradients of the step before, freed first
    held = re.search(r"\nheld at its peak by one training step of that batch \(forward, "
                     r"backward, update\), beyond what was allocated before it: "
                     r"annotated_transformer ([\d.]+) MiB, transformer ([\d.]+) MiB, "
                     r"annotated_transformer without packing ([\d.]+) MiB; "
                     r"annotated_transformer / transformer: ([\d.]+)x\n", out)
    assert held, out[-2000:]
    for peak, kept_mib in zip(map(float, held.groups()[:3]), (ours, theirs, unpacked)):
        assert peak >= kept_mib - 2.0  # the tiny models' gradients: 1.6 MiB
    assert abs(float(held[4]) - float(held[1]) / float(held[2])) <= 0.006
    assert ("\nlive at the peak of transformer's step of the timed batch with the most positions "
            "(") in out


def test_what_is_kept_for_backward_is_counted_once_per_storage_by_the_operator_that_made_it():
    """kept_for_backward: each saved storage once, parameters (and views of them) excluded, under
    the grad_fn (and dtype) of the tensor saved. A stand-in trainer: relu(x W^T) * m + x * W[0],
    summed; x is a leaf used twice, m is made outside autograd."""

    class Trainer:
        model = torch.nn.Linear(256, 256, bias=False)

        @staticmethod
        def criterion(model, sample):
            x, m = sample["x"], sample["m"]
            return (torch.relu(model(x)) * m).sum() + (x * model.weight[0]).sum()

        @staticmethod
        def _prepare_sample(sample):
            return sample, False

    def live_tensors():
        gc.collect()
        return sum(isinstance(o, torch.Tensor) for o in gc.get_objects())

    x = torch.ones(1024, 256, requires_grad=True)  # 1 MiB
    sample, trainer = {"x": x, "m": torch.rand(1024, 256)}, Trainer()
    before = live_tensors()
    kept = memory.kept_for_backward(trainer, sample)
    # x (kept by both products), relu's output and m, 1 MiB each; W^T and W[0] are parameters'
    assert kept == {"leaf float32": 1.0, "ReluBackward0 float32": 1.0, "no grad float32": 1.0}
    # and nothing of that forward outlives it (relu keeps its own output: no cycle through
    # autograd that gc cannot see; on a GPU a sweep's sizes ran out of memory that way)
    assert live_tensors() == before


def test_steps_in_process_read_each_models_step_peak_around_one_training_step(
        tmp_path, capsys, monkeypatch):
    """Given the memory counters (on a GPU torch.cuda's, cuda_peak.PeakCounter),
    steps_in_process prints what one training step holds at its peak beyond what was allocated
    before it, for each model, with their ratio. A recorder stands in for the counters here:
    each model's reading brackets exactly one training step of that model, and the figures
    printed are its own."""
    from fairseq.trainer import Trainer

    data_bin = reverse_data_bin(tmp_path / "data", "--train", 400, "--valid", 20, "--test", 10)
    stepped = []
    train_step = Trainer.train_step
    monkeypatch.setattr(Trainer, "train_step", lambda self, samples, *a, **k: (
        stepped.append(self.model), train_step(self, samples, *a, **k))[1])

    class Recorder:  # each step's peak beyond what was allocated before it: 10, 11, ... MiB
        readings = []

        def peak_of(self, work):
            before = len(stepped)
            work()
            assert len(stepped) == before + 1  # one step of work
            self.readings.append(type(stepped[-1]).__name__)
            return (10 + len(self.readings) - 1) * 2 ** 20

        def live_at_peak_of(self, work):  # cuda_peak.PeakCounter's: one step of the model
            before = len(stepped)
            work()
            assert len(stepped) == before + 1
            model = type(stepped[-1]).__name__
            return 3 * 2 ** 20, {f"{model}.py:1 forward": 2 * 2 ** 20, "(before)": 2 ** 19,
                                 **{f"small.py:{i} f": 2 ** 17 for i in range(8)}}

    steps.steps_in_process(str(data_bin), "tiny", 1024, 2, memory=Recorder())
    out = capsys.readouterr().out
    # two batches (the most target padding, the most positions), each model's step on each
    assert Recorder.readings == ["AnnotatedTransformerModel", "TransformerModel"] * 2
    for ours, theirs, ratio in ((10, 11, 0.91), (12, 13, 0.92)):
        assert ("\nheld at its peak by one training step of that batch (forward, backward, "
                f"update), beyond what was allocated before it: annotated_transformer {ours}.0 "
                f"MiB, transformer {theirs}.0 MiB; annotated_transformer / transformer: "
                f"{ratio}x\n") in out, out[-2000:]
    # then what was live at each model's peak, by line: the 8 largest, then the rest together
    for model, name in (("AnnotatedTransformerModel", "annotated_transformer"),
                        ("TransformerModel", "transformer")):
        for batch in ("target padding", "positions"):
            table = (f"\nlive at the peak of {name}'s step of the timed batch with the most "
                     f"{batch} (3.0 MiB beyond what was allocated before it), by the line that "
                     "allocated it:\n| MiB | allocated at |\n|---|---|\n"
                     f"| 2.0 | {model}.py:1 forward |\n| 0.5 | (before) |\n"
                     + "".join(f"| 0.1 | small.py:{i} f |\n" for i in range(6))
                     + "| 0.2 | 2 other lines |\n")
            assert table in out, out[-3000:]


def cudnn_attention_allowed():
    """torch's cuDNN attention switch; None where this torch has no such backend (< 2.2)."""
    return (torch.backends.cuda.cudnn_sdp_enabled()
            if hasattr(torch.backends.cuda, "cudnn_sdp_enabled") else None)


def counted_train_steps(monkeypatch):
    """Each fairseq Trainer.train_step from now on, as (the model's class, whether torch's cuDNN
    attention was allowed during it); steps_in_process's memory readings and operation counts
    left out (their steps are not the timed ones)."""
    from fairseq.trainer import Trainer

    calls, train_step = [], Trainer.train_step

    def recorded(self, samples, *args, **kwargs):
        calls.append((type(self.model).__name__, cudnn_attention_allowed()))
        return train_step(self, samples, *args, **kwargs)

    monkeypatch.setattr(Trainer, "train_step", recorded)
    monkeypatch.setattr(steps, "print_memory", lambda *args: None)
    monkeypatch.setattr(steps, "print_live_at_peak", lambda *args: None)
    monkeypatch.setattr(steps, "print_launches", lambda *args: None)
    return calls


def test_a_training_steps_launches_and_reads_are_counted_by_part_as_a_direct_count_finds_them(
        tmp_path, capsys):
    """launches.count_step counts the forward with the loss, the backward and the whole step of
    fairseq's train_step: the forward as counting the criterion's call on the same batch
    directly finds it; our model reads back one value per stack (test_model), the backward
    none; fairseq's transformer reads more, and on this batch launches more in both. The
    in-process steps print the counts."""
    from fairseq_plugin.benchmark import launches, main
    from fairseq_plugin.testing.operations import OperationCounter

    data_bin = reverse_data_bin(tmp_path / "data", "--train", 300, "--valid", 20, "--test", 10)
    counts = {}
    for arch in (common.OURS, common.THEIRS):
        trainer = steps.fairseq_trainer(common.training_flags(
            str(data_bin), arch, "tiny", 1024, main.plugin_dir()))
        batches = steps.epochs_of_batches(trainer)
        trainer.train_step([next(batches)])  # the optimizer's state made
        sample = next(batches)
        counts[arch] = launches.count_step(trainer, sample)
        trainer.model.train()
        with OperationCounter() as direct:
            trainer.criterion(trainer.model, trainer._prepare_sample(sample)[0])
        forward, backward, whole = (counts[arch][part] for part in launches.PARTS)
        assert forward[0] == direct.launches and forward[1] == direct.reads, arch
        assert whole[0] > forward[0] + backward[0] and whole[1] >= forward[1] + backward[1]
        assert "forward" not in vars(trainer.criterion)  # the class's methods again
    ours, theirs = counts[common.OURS], counts[common.THEIRS]
    assert ours["forward and loss"][1] == 2 and ours["backward"][1] == 0
    assert ours["forward and loss"][0] < theirs["forward and loss"][0]
    assert ours["backward"][0] < theirs["backward"][0]
    steps.steps_in_process(str(data_bin), "tiny", 1024, 2)
    out = capsys.readouterr().out
    assert ("operations launched / values read back by one training step of the timed batch "
            "with the most target padding:") in out
    printed = re.findall(r"\n  (\S+): forward and loss (\d+) / (\d+), backward (\d+) / (\d+), "
                         r"whole step (\d+) / (\d+)", out.split(
                             "operations launched / values read back by one training step of "
                             "the timed batch with the most positions:")[1])
    assert [name for name, *_ in printed] == [common.OURS, common.THEIRS], out[-2000:]
    ours, theirs = ([int(n) for n in row[1:]] for row in printed)
    assert (ours[1], ours[3]) == (2, 0) and theirs[1] > 2  # (launches: packing adds some)


def test_a_max_tokens_sweep_warms_each_model_up_on_an_epoch_and_tables_each_size(
        tmp_path, monkeypatch, capsys):
    """--max-tokens A,B with --steps-in-process N: each size's steps in turn, then a table whose
    figures are the per-size lines'; --warm-up-epoch: every model first trains on a whole epoch
    of that size's batches, untimed; more steps than an epoch has batches go on into the next."""
    from fairseq_plugin.benchmark import main

    data_bin = reverse_data_bin(tmp_path / "data", "--train", 300, "--valid", 20, "--test", 10)
    epoch = {}
    for size in (512, 2048):
        trainer = steps.fairseq_trainer(common.training_flags(
            str(data_bin), common.OURS, "tiny", size, main.plugin_dir()))
        epoch[size] = len(trainer.get_train_iterator(epoch=1))
    assert epoch[512] > epoch[2048] >= 2
    calls = counted_train_steps(monkeypatch)
    n = epoch[2048] + 1  # at 2048, into the second epoch
    main.main(["--data-bin", str(data_bin), "--preset", "tiny", "--max-tokens", "512,2048",
               "--steps-in-process", str(n), "--warm-up-epoch"])
    out = capsys.readouterr().out
    models = [m for m, _ in calls]
    ours, theirs = "AnnotatedTransformerModel", "TransformerModel"
    assert models.count(ours) == models.count(theirs) == epoch[512] + epoch[2048] + 2 * n
    # per size, its lines; the table's cells are their figures
    words = {name: [float(w) for w in re.findall(
        rf"\n{name}: (\d+) target words/s over the timed steps, [\d.]+ TFLOP/s, [\d.]+% MFU",
        out)] for name in (common.OURS, common.THEIRS)}
    assert "--max-tokens 512: " in out and "--max-tokens 2048: " in out
    rows = re.findall(r"\n\| (\d+) \| (\d+) \(([\d.]+)%\) \| (\d+) \(([\d.]+)%\) \| "
                      r"([\d.]+)x \|", out)
    assert [int(r[0]) for r in rows] == [512, 2048], out[-3000:]
    ratios = [float(m) for m in re.findall(r"median of the per-step ratios ([\d.]+)x", out)]
    for i, row in enumerate(rows):
        assert abs(float(row[1]) - round(words[common.OURS][i])) <= 1
        assert abs(float(row[3]) - round(words[common.THEIRS][i])) <= 1
        assert abs(float(row[5]) - ratios[i]) <= 0.006
    assert f"| --max-tokens ({n} steps each, alternated) |" in out


def test_in_process_the_transformer_without_cudnn_runs_its_steps_with_it_off_and_only_those(
        tmp_path, monkeypatch):
    """--also-transformer-without-cudnn in --steps-in-process: a second fairseq transformer whose
    every step (warm-up and timed) runs with torch's cuDNN attention backend off, the user's
    setting back after each; the other models' steps see the user's setting. A torch without
    that backend (< 2.2) has nothing to switch: the steps run as they are."""
    from collections import Counter

    data_bin = reverse_data_bin(tmp_path / "data", "--train", 300, "--valid", 20, "--test", 10)
    calls = counted_train_steps(monkeypatch)
    user = cudnn_attention_allowed()
    seconds, _ = steps.steps_in_process(str(data_bin), "tiny", 1024, 2,
                                        transformer_without_cudnn=True)
    assert set(seconds) == {common.OURS, common.THEIRS, common.THEIRS_NO_CUDNN}
    if user is None:
        assert Counter(calls) == {("AnnotatedTransformerModel", None): 5,
                                  ("TransformerModel", None): 10}
        return
    assert Counter(calls) == {("AnnotatedTransformerModel", user): 5,
                              ("TransformerModel", user): 5, ("TransformerModel", False): 5}
    assert user  # torch's default: allowed, so the two transformers' steps differ above
    assert torch.backends.cuda.cudnn_sdp_enabled() is user


def test_the_step_ratios_take_the_faster_of_fairseqs_two_runs_of_each_batch(capsys):
    """With the transformer also run without cuDNN attention, each step's baseline is the
    faster of its two runs of that batch, in all and per step; the sweep table says the same."""
    from fairseq_plugin.benchmark import main

    seconds = {common.OURS: [1.0, 2.0], common.THEIRS: [2.0, 2.0],
               common.THEIRS_NO_CUDNN: [3.0, 1.0]}
    flops = {"peak": 1e12, common.OURS: 1e9, common.THEIRS: 1e9}
    figures = main.print_step_times(seconds, 300, flops)
    out = capsys.readouterr().out
    # baseline [2, 1]: in all 3 s / 3 s, per step 2/1 and 1/2
    assert "transformer / annotated_transformer: 1.000x in all (3.000 s / 3.000 s), median of " \
           "the per-step ratios 1.250x" in out
    assert figures[common.OURS] == (100.0, 1.25)
    main.print_sweep_table({8192: figures}, flops, 2)
    out = capsys.readouterr().out
    assert ("| 8192 | 100 (10.0%) | 75 (7.5%) | 75 (7.5%) | 1.25x |") in out, out


def test_step_options_without_steps_in_process_are_one_error_line():
    proc = subprocess.run([*BENCHMARK, "--without-packing"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-1] == ("annotated-benchmark: error: --profile-steps, "
                                            "--without-packing, --gpu-paths-on-cpu and "
                                            "--warm-up-epoch go with --steps-in-process N")


@pytest.mark.skipif(FAIRSEQ_BREAKS_POST_LN, reason="fairseq 0.12.2's own transformer (post-LN) "
                    "cannot decode padded batches (fairseq #4858): the benchmark's generation "
                    "needs fairseq-fixed")
def test_bf16_trains_and_decodes_in_bf16_though_fairseq_012_ties_its_flag_to_tpus(tmp_path):
    """fairseq 0.12's --bf16 also switches on --tpu, and fairseq-generate has no bf16: the
    benchmark's fairseq processes train with --tpu switched back off (the checkpoint's options:
    bf16, not tpu; fairseq's trainer then makes the model bf16) and decode the checkpoint turned
    to bf16 (which the benchmark checks in fairseq-generate's output)."""
    import torch

    data_bin = reverse_data_bin(tmp_path / "data", "--train", 400, "--valid", 50, "--test", 16)
    out = benchmark("--data-bin", str(data_bin), "--precision", "bf16", "--rounds", "1",
                    "--train-updates", "10", "--gen-length", "8", "--skip-cache",
                    "--skip-ctranslate2", work=tmp_path / "work")
    assert ", cpu bf16, data " in out
    assert "| generation beam 5, tokens/s | annotated_transformer |" in out
    for name in ("annotated_transformer", "transformer"):
        saved = torch.load(tmp_path / "work" / f"{name}-round0" / "checkpoint_last.pt",
                           weights_only=False)
        assert (saved["cfg"]["common"]["bf16"], saved["cfg"]["common"]["tpu"]) == (True, False)


def test_a_work_dir_with_files_is_one_error_line_not_a_resumed_run(tmp_path):
    (tmp_path / "annotated_transformer-round0").mkdir()
    proc = subprocess.run([*BENCHMARK, "--work-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-1] == (
        f"annotated-benchmark: error: --work-dir {tmp_path} is not empty (fairseq-train would resume "
        "its checkpoints); give a new or empty directory, and --data-bin DIR to reuse prepared "
        "data")


def test_a_ratio_row_gives_the_median_of_the_per_round_ratios_not_the_ratio_of_medians():
    row = report.ratio_row("train", "ours", [100, 300], [200, 100])
    # medians 200 and 150 (ratio 1.33); per-round ratios 0.5 and 3.0, their median 1.75
    assert row == "| train | ours | 200 | 150 | 1.75x | 0.50 3.00 |"


def test_rounds_alternate_the_order_so_that_even_rounds_balance_it():
    alternated = common.alternated
    orders = [alternated(["A", "B", "C"], i) for i in range(4)]
    assert orders == [["A", "B", "C"], ["C", "B", "A"], ["A", "B", "C"], ["C", "B", "A"]]
    for model in "ABC":  # over an even number of rounds every place is each model's equally often
        places = sorted(order.index(model) for order in orders)
        assert places == sorted(2 - p for p in places)


@pytest.mark.parametrize("dataset_impl", ["mmap", "cached"])
def test_decoding_part_of_a_test_set_takes_its_first_sentences(tmp_path, dataset_impl):
    from fairseq.data import Dictionary, data_utils

    from conftest import cli
    from fairseq_plugin.cli import reverse_task

    reverse_task.main([str(tmp_path / "raw"), "--train", "50", "--valid", "10", "--test", "30"])
    data_bin = tmp_path / "bin"
    cli("fairseq-preprocess", "--source-lang", "src", "--target-lang", "tgt",
        *[f for s in ("train", "valid", "test") for f in (f"--{s}pref", f"{tmp_path}/raw/{s}")],
        "--destdir", data_bin, "--joined-dictionary", "--dataset-impl", dataset_impl)
    subset = data.first_test_sentences(str(data_bin), 7, str(tmp_path / "work"))
    for lang in ("src", "tgt"):
        d = Dictionary.load(os.path.join(data_bin, f"dict.{lang}.txt"))
        full, first = (data_utils.load_indexed_dataset(os.path.join(folder, f"test.src-tgt.{lang}"),
                                                       d) for folder in (str(data_bin), subset))
        assert len(full) == 30 and len(first) == 7
        if dataset_impl == "cached":  # (read only what was prefetched)
            full.prefetch(range(7))
        assert all(first[i].tolist() == full[i].tolist() for i in range(7))


@pytest.mark.main_lane  # the benchmark's own option checks, whatever fairseq's version
@pytest.mark.parametrize("args, message", [
    (["--rounds", "0"], "argument --rounds: '0': give a whole number of at least 1"),
    (["--test-sentences", "x"], "argument --test-sentences: 'x': give a whole number of at least 1"),
    (["--cache-lengths", "25,abc"], "argument --cache-lengths: '25,abc': give target lengths of "
                                    "at least 1, separated by commas, e.g. 25,50,100"),
    (["--steps-in-process", "0"], "argument --steps-in-process: '0': give a whole number of at "
                                  "least 1"),
    (["--steps-in-process", "2", "--profile-steps", "3"], "--profile-steps 3: at most the 2 steps "
                                                          "of --steps-in-process"),
    (["--data-bin", "{tmp}/missing"], "--data-bin {tmp}/missing: no such folder; give one made by "
                                      "fairseq-preprocess or annotated-prepare"),
    (["--data-bin", "{tmp}"], "--data-bin {tmp} has no test split (test.*) to decode; binarise "
                              "one with --testpref"),
    (["--before", "{tmp}/missing"], "--before {tmp}/missing: no such folder; give one made by a "
                                    "checkout's fairseq_plugin folder"),
    (["--no-cudnn-attention"], "--no-cudnn-attention: the cuDNN attention backend exists on a "
                               "GPU only; add --device cuda"),
    (["--work-dir", "{tmp}/a_file"], "--work-dir {tmp}/a_file is a file; give a new or empty "
                                     "directory"),
    (["--skip-generation", "--decoding-in-process"], "--skip-generation --decoding-in-process: "
                                                     "the second decodes; leave out one"),
    (["--also-transformer-without-cudnn"], "--also-transformer-without-cudnn: for a GPU run with "
                                           "cuDNN attention allowed; add --device cuda, leave "
                                           "out --no-cudnn-attention"),
    (["--max-tokens", "8192,x"], "argument --max-tokens: '8192,x': give whole numbers of at "
                                 "least 1, separated by commas, e.g. 8192,16384"),
    (["--max-tokens", "8192,16384"], "--max-tokens 8192,16384: several sizes (a sweep) go with "
                                     "--steps-in-process N; give one size for the rounds"),
])
def test_bad_benchmark_options_are_one_error_line_before_any_work(args, message, tmp_path,
                                                                  capsys):
    """In this process (the command's start-up, a few seconds each, is paid once, below)."""
    from fairseq_plugin.benchmark.main import main

    (tmp_path / "a_file").write_text("")
    with pytest.raises(SystemExit) as stop:
        main([a.format(tmp=tmp_path) for a in args])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == "annotated-benchmark: error: " + message.format(tmp=tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["a_file"]


@pytest.mark.main_lane
def test_the_benchmark_command_refuses_a_bad_option_in_one_line_of_its_own():
    proc = subprocess.run([*BENCHMARK, "--rounds", "0"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-1] == ("annotated-benchmark: error: argument --rounds: '0': "
                                            "give a whole number of at least 1")


def test_without_cudnn_attention_every_gpu_process_switches_it_off_before_fairseq_runs():
    command = common.Device("cuda", "fp16", cudnn_attention=False).command(["fairseq-generate", "x"])
    setup = setup_code(command)
    assert (setup.index("import importlib.util, sys, torch;") < setup.index(
        "torch.backends.cuda.enable_cudnn_sdp(False);") < setup.index("cli_process.run("))
    assert command[-2:] == ["fairseq-generate", "x"]
    assert "enable_cudnn_sdp" not in setup_code(common.Device("cuda", "fp16").command(["x"]))


def setup_code(command):
    """The Python code that a benchmark's child process runs before fairseq's script (-c's)."""
    return command[command.index("-c") + 1]


class StandInAllocator:
    """torch.cuda's counters and memory history as cuda_peak uses them, for tests: ``use`` makes
    or frees a block (at an address, allocated at a given line) and records it while recording."""

    def __init__(self):
        self.allocated = self.peak = 0
        self.recording, self.trace, self.blocks = False, [], {}
        self.memory = self  # torch.cuda.memory's two functions are on this object too

    def synchronize(self):
        pass

    def current_device(self):
        return 0

    def memory_allocated(self):
        return self.allocated

    def max_memory_allocated(self):
        return self.peak

    def reset_peak_memory_stats(self):
        self.peak = self.allocated

    def _record_memory_history(self, enabled="all", stacks="all"):
        self.recording = enabled is not None

    def _snapshot(self):
        self.trace.append({"action": "snapshot"})  # as torch's, which notes each snapshot
        return {"device_traces": [list(self.trace)]}

    def use(self, addr, n_bytes=None, line=("model.py", 1, "forward")):
        """A block of ``n_bytes`` made at ``addr``; without n_bytes, the one there freed."""
        if n_bytes is None:
            n_bytes = -self.blocks.pop(addr)
            entry = {"action": "free_requested", "addr": addr, "size": -n_bytes, "frames": []}
        else:
            self.blocks[addr] = n_bytes
            torch_frame = {"filename": f"{os.sep}x{os.sep}torch{os.sep}nn{os.sep}f.py", "line": 9,
                           "name": "linear"}
            entry = {"action": "alloc", "addr": addr, "size": n_bytes, "frames": [
                torch_frame, {"filename": line[0], "line": line[1], "name": line[2]}]}
        self.allocated += n_bytes
        self.peak = max(self.peak, self.allocated)
        if self.recording:
            self.trace.append(entry)


def test_the_gpu_peak_outlasts_fairseqs_resets_of_the_counter(monkeypatch, capsys):
    """fairseq's trainer resets torch.cuda's peak counter after every step; what the benchmark
    reads (cuda_peak.py, set up in every GPU process before fairseq runs) is still the
    most allocated at once over the whole command. A stand-in for torch.cuda counts here."""

    at_exit = []
    monkeypatch.setattr(cuda_peak.atexit, "register", at_exit.append)
    cuda = StandInAllocator()
    cuda.use(1, 100 * 2 ** 20)  # before switch_on: counted only as what stays allocated
    cuda.use(2, 50 * 2 ** 20)
    cuda.use(2)
    counter = cuda_peak.switch_on(cuda)
    for step_peak in (300, 500, 200):  # three training steps, the counter reset after each
        cuda.use(3, step_peak * 2 ** 20)
        cuda.use(3)
        cuda.reset_peak_memory_stats()  # what fairseq calls: torch.cuda.reset_peak_memory_stats
    assert cuda.max_memory_allocated() == 100 * 2 ** 20  # the counter alone lost the steps
    assert counter.peak() == 600 * 2 ** 20
    at_exit[0]()
    # when: fairseq resets the counter after every step, so the 500 came in step 2 of 3
    assert capsys.readouterr().out == ("cuda peak MB 600.0 in training step 2 of 3; 100.0 MB "
                                       "allocated between steps\n")
    # around one step (step_peak_mib): from what is allocated at its start, the reset inside
    assert counter.start() == 100 * 2 ** 20
    cuda.use(4, 250 * 2 ** 20)
    cuda.use(4)
    cuda.reset_peak_memory_stats()
    assert counter.peak() == 350 * 2 ** 20

    def step():
        cuda.use(5, 250 * 2 ** 20)
        cuda.use(5)
        cuda.reset_peak_memory_stats()

    assert counter.peak_of(step) == 250 * 2 ** 20  # beyond the 100 MiB allocated before it
    gpu = common.Device("cuda", "fp16")
    out = f"log\n{cuda_peak.PRINTED} 600.0 in training step 2 of 3; 100.0 MB allocated\nend\n"
    assert gpu.peak_mb(out, 0) == 600.0
    assert gpu.peak_where(out) == "in training step 2 of 3; 100.0 MB allocated"
    assert common.CPU.peak_mb(out, 7.0) == 7.0 and common.CPU.peak_where(out) == ""
    setup = setup_code(common.Device("cuda", "fp16").command(["fairseq-train", "x"]))
    # the child imports cuda_peak.py by its path, not through the package (whose __init__ would
    # register the plugin before fairseq imports its --user-dir), and edits no sys.path
    here = os.path.dirname(cuda_peak.__file__)
    assert (setup.index(repr(os.path.join(here, "cuda_peak.py")))
            < setup.index("cuda_peak.switch_on();")
            < setup.index(repr(os.path.join(here, "cli_process.py")))
            < setup.index("cli_process.run("))
    assert "sys.path" not in setup and "fairseq_plugin" not in setup.replace(here, "")


def test_the_gpu_peak_after_the_last_step_and_without_steps_says_so(monkeypatch, capsys):
    cuda = StandInAllocator()
    counter = cuda_peak.PeakCounter(cuda)
    counter.start()
    assert counter.where() == "(no training step)"  # e.g. fairseq-generate
    cuda.use(1, 300)
    cuda.reset_peak_memory_stats()  # step 1 ends, 300 bytes stay
    cuda.use(2, 2 ** 20)  # saving, after the last step
    assert counter.where() == "after the last training step; 0.0 MB allocated between steps"


def test_live_at_peak_names_the_lines_live_at_the_peak_of_a_recorded_step():
    """PeakCounter.live_at_peak_of records torch.cuda's memory history around the work and
    replays it: the peak beyond what was allocated before, and what was live then by the line
    outside torch that allocated it; memory allocated before and freed during the work counts
    negative, so the peak falls where the allocator's did. A stand-in for torch.cuda here."""
    cuda = StandInAllocator()
    counter = cuda_peak.PeakCounter(cuda)
    cuda._record_memory_history("all")  # an earlier recording: not part of the work's
    cuda.use(100, 4000, ("old.py", 1, "f"))
    cuda._record_memory_history(None)
    cuda.use(200, 1000)  # before the work (a gradient freed during it)

    def work():
        cuda.use(200)  # -1000
        cuda.use(1, 3000, (f"{os.sep}a{os.sep}fairseq_plugin{os.sep}modules{os.sep}attention.py",
                           50, "forward"))
        cuda.use(2, 500, ("layers.py", 7, "forward"))
        cuda.use(3, 1500, ("layers.py", 7, "forward"))  # the peak: 3000 + 2000 - 1000 = 4000
        cuda.use(1)
        cuda.use(4, 3500, ("loss.py", 3, "backward"))  # the peak: 2000 + 3500 - 1000 = 4500
        cuda.use(4)
        cuda.use(2)

    peak, live = counter.live_at_peak_of(work)
    assert not cuda.recording
    assert peak == 4500  # after freeing 1: layers 2000, loss 3500, the freed gradient -1000
    assert live == {"layers.py:7 forward": 2000, "loss.py:3 backward": 3500,
                    cuda_peak.BEFORE: -1000}
    # frames inside torch are passed over; the path is cut to its last three parts
    attention = next(e for e in cuda.trace if e.get("addr") == 1 and e["action"] == "alloc")
    assert cuda_peak.allocating_line(attention["frames"]) == (
        "fairseq_plugin/modules/attention.py:50 forward")
    assert cuda_peak.allocating_line([]) == cuda_peak.NO_FRAME


def test_where_torch_cannot_watch_storages_the_cpu_peak_is_one_error_and_the_benchmark_says_so(
        tmp_path, capsys, monkeypatch):
    """On a torch whose storages do not keep their Python object (2.1.2), storage_peak refuses
    with one line saying so, and steps_in_process prints that line instead of the step peaks."""
    monkeypatch.setattr(storage_peak, "storages_keep_their_python_object", lambda: False)
    with pytest.raises(RuntimeError, match=r"^storage_peak: this torch's storages do not keep "):
        storage_peak.StoragePeakCounter().peak_of(lambda: None)
    data_bin = reverse_data_bin(tmp_path / "data", "--train", 400, "--valid", 20, "--test", 10)
    steps.steps_in_process(str(data_bin), "tiny", 1024, 1)
    out = capsys.readouterr().out
    assert f"\n(no step peaks on the CPU: {storage_peak.UNSUPPORTED})\n" in out
    assert "\nkept for backward by one training forward" in out
    assert "held at its peak" not in out and "live at the peak" not in out


@needs_watchable_storages
def test_the_cpu_peak_counts_each_storage_from_the_operator_that_makes_it_to_its_freeing():
    """storage_peak, the CPU's counterpart of cuda_peak.PeakCounter: a storage counts from the
    operator that made it until it is freed, views and in-place results add nothing, and one
    alive before the work and freed in it counts negative."""
    held = [torch.ones(1000)]  # 4000 bytes made before the work

    def work():
        held.clear()  # -4000
        a = torch.ones(2000)  # 8000
        view = a[:10]
        a.add_(1)
        view.mul_(2)
        b = a * 2  # 8000 more: the peak, 16000 - 4000
        del a, view
        c = b + 1  # 8000, after a's 8000 were freed
        del b, c
        torch.ones(1500)  # 6000, freed at once

    assert storage_peak.StoragePeakCounter().peak_of(work) == 12000


@needs_watchable_storages
def test_the_cpu_peak_counts_no_view_or_in_place_result_of_a_tensor_it_did_not_find(monkeypatch):
    """A tensor alive before the work that the trace did not find among Python's objects (one
    that only C++ holds, say): its views and in-place results inside are not new memory."""
    monkeypatch.setattr(storage_peak.gc, "get_objects", lambda: [])
    unseen = torch.ones(1000)

    def work():
        unseen.mul_(2)
        unseen[:500].add_(1)
        unseen.view(10, 100).t_()

    assert storage_peak.StoragePeakCounter().peak_of(work) == 0


@needs_watchable_storages
def test_the_cpu_peak_sees_autograds_backward_and_names_the_line_that_ran_it():
    x = torch.ones(1000, requires_grad=True)

    def work():
        loss = (x * x).sum()  # the product, 4000 bytes, goes after the sum
        loss.backward()  # x's gradient from two products of 4000: more than the forward held

    peak, live = storage_peak.StoragePeakCounter().live_at_peak_of(work)
    backward_line = [n for line, n in live.items()
                     if re.fullmatch(r".*tests/test_benchmark\.py:\d+ work", line)
                     and n >= 8000]
    assert peak >= 8000 and backward_line, live
    assert x.grad is not None and float(x.grad[0]) == 2.0


# fairseq CLI stand-ins: a command that finishes and then aborts in Python's shutdown (as fp16
# fairseq-train did on an H100: cli_process.py), and two that fail
ABORTS_AFTER_FINISHING = """
import atexit, os, queue, threading
print("done training")
atexit.register(os.abort)  # SIGABRT after the script's end, as in the interpreter's shutdown
threading.Thread(target=queue.Queue().get, name="waiting", daemon=True).start()
"""
ABORTS_BEFORE_FINISHING = "import os; print('training'); os.abort()"
EXITS_WITH_STATUS_1 = "import sys; print('training'); sys.exit(1)"


def test_a_command_that_finished_keeps_its_figures_through_an_abort_in_shutdown_and_says_so(
        tmp_path, capsys):
    """A child that ends its work (exit status 0) and then aborts while Python shuts down keeps
    its output, with a note and a count; one that aborts or fails before its end is an error."""
    runs.ABORTED_AFTER_FINISHING.clear()
    device = common.Device("cpu", "bf16")  # a child with set-up code (fairseq_bf16), as on a GPU
    scripts = {}
    for name, code in (("finished-then-aborted", ABORTS_AFTER_FINISHING),
                       ("aborted", ABORTS_BEFORE_FINISHING), ("failed", EXITS_WITH_STATUS_1)):
        scripts[name] = tmp_path / name
        scripts[name].write_text(code)
    out, _ = runs.run_measured([scripts["finished-then-aborted"]], device)
    assert "done training" in out
    assert runs.ABORTED_AFTER_FINISHING == ["finished-then-aborted"]
    note = capsys.readouterr().out
    assert "finished-then-aborted finished (exit status 0), then aborted" in note
    assert "Fatal Python error: Aborted" in note  # faulthandler's report of the threads
    # the threads alive when the script had finished, and where, in its output and in the note
    alive = (r"cli_process: threads alive at the end: waiting \(Thread, daemon\), at "
             r"\S+\.py:\d+ in \w+\n")
    assert re.search(r"\n" + alive, out), out
    assert re.search(r"\n  " + alive, note), note
    for name in ("aborted", "failed"):
        with pytest.raises(SystemExit, match=f"benchmark: error: {name} failed"):
            runs.run_measured([scripts[name]], device)
    assert runs.ABORTED_AFTER_FINISHING == ["finished-then-aborted"]


def test_skip_generation_measures_training_alone_and_decodes_nothing(tmp_path):
    """Training's round lines and rows only, nothing decoded (so it runs on fairseq 0.12.2 too,
    whose own transformer cannot decode padded batches: there the benchmark's only whole run)."""
    data_bin = reverse_data_bin(tmp_path / "data", "--train", 400, "--valid", 50, "--test", 16)
    out = benchmark("--data-bin", str(data_bin), "--rounds", "1", "--train-updates", "20",
                    "--skip-generation", work=tmp_path / "work")
    assert "training only (--skip-generation)" in out
    assert len(re.findall(r"(?m)^  round 1 (?:annotated_transformer|transformer) +train .* MB   "
                          r"\(the command took \d+ s\)$", out)) == 2, out
    labels = [line.split("|")[1].strip() for line in out.splitlines()
              if line.startswith("| ") and "| annotated_transformer |" in line]
    assert labels == ["training, target words/s", "training after the first epoch, target words/s",
                      "training peak memory, MB"], out[-2000:]
    # nothing decoded: no CTranslate2 export, no cache table, no fairseq-generate output
    assert "CTranslate2" not in out and "| greedy |" not in out and "beam-5" not in out
    assert not list((tmp_path / "work").rglob("*generate*"))
    # each model's FLOPs per target token, the peak, and each run's FLOP/s and MFU from them
    per_token = {m[1]: float(m[2]) * 1e9 for m in re.finditer(
        r"\n(annotated_transformer|transformer): ([\d.e-]+) GFLOP per target token = 6 x \(",
        out)}
    assert sorted(per_token) == ["annotated_transformer", "transformer"], out[:3000]
    peak = float(re.search(r"\npeak: ([\d.]+) TFLOP/s, the CPU's measured fp32 matrix-product "
                           r"rate, \d+ threads\n", out)[1]) * 1e12
    runs = re.findall(r"\n  round 1 (annotated_transformer|transformer) +train +(\d+) wps.*\n"
                      r"          training ([\d.e-]+) TFLOP/s, ([\d.]+)% MFU\n", out)
    assert len(runs) == 2, out[-3000:]
    for name, wps, tflops, share in runs:  # printed to 4 significant digits, wps to units
        achieved = per_token[name] * float(wps)
        assert float(tflops) * 1e12 == pytest.approx(achieved, rel=0.002)
        assert float(share) == pytest.approx(100 * float(tflops) * 1e12 / peak, rel=0.01)
    assert re.search(r"\nmodel FLOPs utilisation in training, medians of the rounds: "
                     r"annotated_transformer [\d.]+% \([\d.]+% after the first epoch\); "
                     r"transformer [\d.]+% \([\d.]+% after the first epoch\)\n", out), out[-1000:]


def commands_naming(text):
    """The running processes whose command line holds ``text`` (Linux's /proc)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    found.append(pid)
        except OSError:  # ended meanwhile
            pass
    return found


@pytest.mark.skipif(FAIRSEQ_BREAKS_POST_LN, reason="fairseq 0.12.2's own transformer (post-LN) "
                    "cannot decode padded batches (fairseq #4858): the benchmark's generation "
                    "needs fairseq-fixed")
def test_stopped_by_sigterm_the_benchmark_reports_its_complete_rounds_with_the_other_models(
        tmp_path):
    """--also-torch-choice adds annotated_transformer trained (and so decoding) with
    --fused-attention-backends torch to every round, --also-without-packing one trained with
    --no-packing; SIGTERM (a timeout's) in the second round prints the table of the first, stops
    fairseq's command and ends in one error line."""
    import signal
    import time

    import torch

    data_bin = reverse_data_bin(tmp_path / "data", "--train", 400, "--valid", 50, "--test", 16)
    proc = subprocess.Popen(
        [*BENCHMARK, *TINY, "--data-bin", str(data_bin), "--rounds", "2",
         "--train-updates", "10", "--gen-length", "8", "--skip-ctranslate2", "--skip-cache",
         "--also-torch-choice", "--also-without-packing", "--work-dir", str(tmp_path / "work")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stdout:  # the benchmark flushes each round's line
        lines.append(line)
        if line.startswith("  round 2 "):  # round 2's first run done: stop in its second
            time.sleep(2)  # inside the next fairseq command
            proc.send_signal(signal.SIGTERM)
            break
    out = "".join(lines) + proc.stdout.read()
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 1
    assert not commands_naming(str(tmp_path / "work"))  # fairseq's command was stopped too
    assert err.splitlines()[-1] == ("benchmark: stopped after 1 of 2 rounds (SIGTERM); the table "
                                    "above gives those"), err[-2000:]
    assert "benchmark: stopped (SIGTERM) in round 2 of 2; the tables give the 1 complete rounds" \
        in out
    assert "| medians of 1 rounds |" in out
    # 10 updates logged every 5: not every run logged an interval after its first epoch
    assert "(no row for training after the first epoch: not every training command" in out
    assert "| training after the first epoch" not in out
    rows = [[c.strip() for c in line.strip("| \n").split("|")] for line in out.splitlines()
            if line.startswith("| training, target words/s |")]
    assert [r[1] for r in rows] == ["annotated_transformer", "annotated_transformer torch-choice",
                                    "annotated_transformer without packing"]
    assert all(len(r[5].split()) == 1 for r in rows)  # one ratio: round 1's
    saved = {name: torch.load(tmp_path / "work" / f"{name}-round0" / "checkpoint_last.pt",
                              weights_only=False)["cfg"]["model"]
             for name in ("annotated_transformer", "annotated_transformer-torch-choice",
                          "annotated_transformer-without-packing")}
    assert saved["annotated_transformer"]["fused_attention_backends"] == "no-cudnn"
    assert saved["annotated_transformer-torch-choice"]["fused_attention_backends"] == "torch"
    assert [saved[name]["no_packing"] for name in saved] == [False, False, True]


def test_training_speed_after_the_first_epoch_leaves_out_the_first_epoch_and_its_boundary():
    """fairseq-train's json intervals: the whole run's median skips the first interval; the
    later median takes only epochs after the first, without the interval that crosses into
    them; None when the run logged nothing after its first epoch; too few intervals: one line."""

    def log(*intervals):  # (epoch, wps) each, as fairseq-train's train_inner lines
        return "\n".join(f'2026-11-27 | INFO | train_inner | {{"epoch": {e}, "update": 1.5, '
                         f'"wps": "{w}", "ups": "1.0"}}' for e, w in intervals) + "\nother line"

    assert runs.training_speeds(log((1, 5), (1, 10), (1, 20), (2, 30), (2, 100), (3, 200),
                                     (3, 300))) == (65, 200)
    assert runs.training_speeds(log((1, 5), (1, 10), (1, 20), (2, 30))) == (20, None)
    with pytest.raises(SystemExit, match="too few logged intervals; raise --train-updates"):
        runs.training_speeds(log((1, 5)))


def test_a_gpu_profile_also_lists_the_operators_by_host_time(capsys):
    """On a GPU the profile's operators come by GPU time, then by the CPU's time with what each
    calls (small decoding steps wait on the host); on the CPU once."""
    # operator: [own GPU s, calls, FLOPs, own CPU s, CPU s with what it calls]
    ops = {"aten::addmm": [0.5, 10, 0, 0.01, 0.02], "aten::sdpa": [0.1, 4, 0, 0.01, 0.3],
           "aten::copy_": [0.2, 7, 0, 0.05, 0.05]}
    profiling.print_profile("t", ops, common.Device("cuda", "fp16"), rows=2)
    lines = capsys.readouterr().out.splitlines()
    start = lines.index("  by the CPU's time, with what each calls:")
    assert [line.split()[-1] for line in lines[start - 2:start]] == ["aten::addmm", "aten::copy_"]
    assert lines[start + 1:] == ["     0.300 s       4 calls  aten::sdpa",
                                 "     0.050 s       7 calls  aten::copy_"]
    profiling.print_profile("t", ops, common.CPU, rows=2)
    assert "by the CPU's time" not in capsys.readouterr().out
    # given the wall time: on a GPU, the share of it the GPU was busy (0.8 s of GPU time in 2 s)
    profiling.print_profile("t", ops, common.Device("cuda", "fp16"), rows=2, wall=2.0)
    assert capsys.readouterr().out.splitlines()[1] == (
        "t: 0.80 s of GPU time (0.07 s of CPU time) in 2.00 s of wall time (the GPU busy 40% of "
        "it), matrix products 0.50 s, 0.0 GFLOP")
    profiling.print_profile("t", ops, common.CPU, rows=2, wall=2.0)
    assert capsys.readouterr().out.splitlines()[1].startswith(
        "t: 0.80 s of CPU time in 2.00 s of wall time, matrix products")


def test_a_decodings_time_is_split_by_where_each_operator_ran_and_what_it_is():
    """time_by_part: each operator's self time once, under the innermost named range around it
    (None outside them all), as a matrix product, attention or other; decoding_parts' rows add
    up to the whole: the model's passes by kind, the reorders, SequenceGenerator's own."""
    from torch.profiler import profile, record_function

    from fairseq_plugin.benchmark import decoding

    x, w = torch.randn(64, 32), torch.randn(32, 32)
    q = torch.randn(2, 4, 8, 16)
    with profile() as prof:
        with record_function("model.forward"):  # a decoder step
            with record_function("inner"):  # not a part: its operators are the step's
                torch.nn.functional.linear(x, w, torch.zeros(32))  # addmm
            x @ w  # mm
            torch.nn.functional.scaled_dot_product_attention(q, q, q)
            torch.bmm(q[0], q[0].transpose(1, 2)).softmax(-1)  # attention, written out
            (x + 1).relu()
        with record_function("model.encoder.forward"):
            x @ w
        with record_function("model.reorder_incremental_state_scripting"):
            x.index_select(0, torch.arange(10))
            x @ w  # in a reorder: the reorder's, whatever its kind
        x.topk(3)  # outside the model: SequenceGenerator's
    ranges = ["model.forward", "model.encoder.forward", "model.reorder_encoder_out",
              "model.reorder_incremental_state_scripting"]
    parts = profiling.time_by_part(prof, ranges)
    assert set(parts) == {("model.forward", "matrix products"), ("model.forward", "attention"),
                          ("model.forward", "other"), ("model.encoder.forward", "matrix products"),
                          ("model.encoder.forward", "other"),  # aten::matmul's own, around mm
                          ("model.reorder_incremental_state_scripting", "matrix products"),
                          ("model.reorder_incremental_state_scripting", "other"),
                          (None, "other")}
    assert all(parts[part, "matrix products"] > 0 for part in ranges if part != ranges[2])
    every_operator = sum(e.self_cpu_time_total for e in prof.events()
                         if e.name.startswith("aten::")) / 1e6
    assert sum(parts.values()) == pytest.approx(every_operator, rel=1e-9)
    rows = dict(decoding.decoding_parts(parts))
    passes = parts["model.forward", "matrix products"]
    passes += parts["model.encoder.forward", "matrix products"]
    assert rows["matrix products of the model's passes (mm, addmm)"] == pytest.approx(passes)
    assert rows["reordering for beam search"] == pytest.approx(
        parts["model.reorder_incremental_state_scripting", "matrix products"]
        + parts["model.reorder_incremental_state_scripting", "other"])
    assert rows["SequenceGenerator's own, log-probabilities included"] == parts[None, "other"]
    *each, whole = rows.values()
    assert whole == pytest.approx(sum(each)) and whole == pytest.approx(every_operator)


def test_attention_new_shapes_times_each_backend_choice_at_shapes_none_other_used(monkeypatch,
                                                                                   capsys):
    """scripts/attention_new_shapes.py: each choice of --fused-attention-backends gets its own
    new shapes (the cost of a new shape is a first call's), and no-cudnn's calls run with
    torch's cuDNN attention switched off."""
    script = load_script("attention_new_shapes")
    sdpa, attend_on = torch.nn.functional.scaled_dot_product_attention, script.attend_on
    calls = []
    cudnn_switch = getattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: None)

    def recorded_attend(backends, q, k, *args):
        calls.append([k.size(2), backends])
        return attend_on(backends, q, k, *args)

    def recorded_sdpa(*args, **kwargs):
        calls[-1].append(cudnn_switch())  # the switch inside the call
        return sdpa(*args, **kwargs)
    monkeypatch.setattr(script, "attend_on", recorded_attend)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recorded_sdpa)
    # on the CPU, the switch as a CUDA device's calls would see it (the CPU's leave it alone)
    fused_backends = script.fused_backends
    monkeypatch.setattr(script, "fused_backends",
                        lambda backends, _: fused_backends(backends, torch.device("cuda")))
    script.main(["--shapes", "3", "--max-tokens", "256"])
    out = capsys.readouterr().out
    tables = re.findall(r"\n(decoding steps|training batches)[^\n]*\n\|[^\n]*\n\|---[^\n]*\n"
                        r"((?:\|[^\n]*\n?)+)", out)
    assert [title for title, _ in tables] == ["decoding steps", "training batches"], out
    for _, rows in tables:
        cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows.splitlines()]
        assert [c[0] for c in cells] == ["torch", "no-cudnn"]
        for backends, operator, first, again, cost, shapes in cells:
            assert operator.startswith("aten::") and shapes == "3"
            assert float(first) > 0 and float(again) > 0
            assert abs(float(first) - float(again) - float(cost)) <= 0.0015
    # the calls: 4 warm-ups (at shapes of their own), then each table's: per choice and shape
    # 1 + 3 timed, then 1 profiled per choice (at its own last shape); keys (rows, h, S, d_k)
    assert len(calls) == 4 + 2 * (2 * 3 * (1 + 3) + 2)
    tables = calls[4:30], calls[30:]
    for table in tables:
        measured, profiled = [tuple(c[:2]) for c in table[:-2]], [tuple(c[:2]) for c in table[-2:]]
        firsts = measured[::4]
        assert [b for _, b in firsts] == ["torch", "no-cudnn", "no-cudnn", "torch", "torch",
                                          "no-cudnn"]
        assert len({S for S, _ in firsts}) == 6  # a new shape each time
        assert all(call == firsts[i // 4] for i, call in enumerate(measured))
        assert profiled == [[f for f in firsts if f[1] == b][-1] for b in ("torch", "no-cudnn")]
    if cudnn_switch() is not None:  # torch >= 2.2: no-cudnn's calls ran with cuDNN off
        assert {(backends, cudnn) for _, backends, cudnn in calls} == {("torch", True),
                                                                       ("no-cudnn", False)}


@pytest.mark.parametrize("args, message", [
    (["--shapes", "0"], "--shapes 0: give a whole number of at least 1"),
    (["--max-tokens", "-3"], "--max-tokens -3: give a whole number of at least 1"),
    (["--device", "cuda"], "--device cuda: torch sees no CUDA GPU here; run with --device cpu"),
])
def test_bad_attention_new_shapes_options_are_one_error_line(args, message, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # also on a GPU machine
    monkeypatch.setattr(sys, "argv", ["attention_new_shapes.py"])  # argparse's program name
    with pytest.raises(SystemExit) as stop:
        load_script("attention_new_shapes").main(args)
    assert stop.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"attention_new_shapes.py: error: {message}"


def test_model_flops_count_each_stacks_layers_the_output_projection_and_the_length_ratio(
        tmp_path):
    """mfu.py: 6 x (N_enc x S/T + N_dec + d_model x V), N counted from each model's own layers
    (here against a count by hand for the tiny preset), S/T from the data's real lengths (here
    sources three times as long as targets)."""
    raw = tmp_path / "raw"
    raw.mkdir()
    for split in ("train", "valid", "test"):
        (raw / f"{split}.src").write_text("a b c d e f\n" * 20)  # 6 tokens + EOS
        (raw / f"{split}.tgt").write_text("a b\n" * 20)  # 2 tokens + EOS
    data_bin = preprocess_reverse(raw, tmp_path / "bin")
    ratio = mfu.source_per_target(str(data_bin))
    assert ratio == pytest.approx(7 / 3)
    layers, d, ff, _ = common.PRESETS["tiny"]
    attention, feed_forward, norm = 4 * (d * d + d), d * ff + ff + ff * d + d, 2 * d
    encoder_layer = attention + feed_forward + 2 * norm
    decoder_layer = 2 * attention + feed_forward + 3 * norm
    for arch in (common.OURS, common.THEIRS):
        model = mfu.built_model(common.training_flags(str(data_bin), arch, "tiny", 1024,
                                                      os.path.join(REPO, "fairseq_plugin")))
        vocabulary = len(model.decoder.dictionary)
        assert mfu.layer_parameters(model) == (layers * encoder_layer, layers * decoder_layer,
                                               d * vocabulary), arch
        assert mfu.flops_per_target_token(model, ratio) == pytest.approx(
            6 * (layers * encoder_layer * 7 / 3 + layers * decoder_layer + d * vocabulary))


def test_the_device_peak_comes_from_the_table_by_name_the_flag_or_the_cpus_measured_rate():
    assert mfu.gpu_peak("NVIDIA H100 80GB HBM3", "bf16") == pytest.approx(989.4e12)
    assert mfu.gpu_peak("NVIDIA H100 PCIe", "fp16") == pytest.approx(756e12)
    assert mfu.gpu_peak("NVIDIA H200", "fp32") == pytest.approx(66.9e12)
    assert mfu.gpu_peak("NVIDIA GeForce RTX 4090", "bf16") is None
    assert mfu.device_peak(common.CPU, 2.5) == (2.5e12, "given by --peak-tflops")
    peak, source = mfu.device_peak(common.CPU)
    assert 1e8 < peak < 1e14 and source.startswith("the CPU's measured fp32 matrix-product rate")
    assert mfu.utilisation(1e9, 2000, 4e12) == "2 TFLOP/s, 50.00% MFU"
    assert mfu.utilisation(1.23456e9, 2000, None) == "2.469 TFLOP/s"


def test_the_cpus_peak_is_the_fastest_product_over_a_time_window_not_ten_in_a_row():
    """A shared machine's short slow spell must not set the peak (it once read below the rate
    training then reached): the products go on for the whole window."""
    import time

    start = time.perf_counter()
    peak = mfu.measured_cpu_peak(size=64, seconds=0.3)
    assert time.perf_counter() - start >= 0.3
    assert 1e8 < peak < 1e14


def test_the_fair_baseline_is_fairseqs_better_run_in_each_round(capsys):
    """--also-transformer-without-cudnn: fairseq's transformer also runs in processes with
    cuDNN attention off, and the ratios are taken against the better of its two runs in each
    round (the faster, the smaller peak)."""
    assert "enable_cudnn_sdp(False)" in setup_code(
        common.without_cudnn(common.Device("cuda", "bf16")).command(["fairseq-train"]))
    assert common.arch_of(common.THEIRS_NO_CUDNN) == common.THEIRS
    figures = lambda wps, mb: {"train_wps": wps, "later_wps": wps, "train_mb": mb,  # noqa: E731
                               "gen_tps": [], "gen_mb": []}
    results = {common.OURS: figures([120, 120], [90, 90]),
               common.THEIRS: figures([100, 60], [80, 100]),
               common.THEIRS_NO_CUDNN: figures([80, 100], [100, 95])}
    report.print_ratio_table(results, {"gen_tps": [], "gen_mb": []}, 2, {"peak": None})
    out = capsys.readouterr().out
    assert "the better of transformer's two runs, with and without cuDNN attention" in out
    # against 100 and 100 words/s, 80 and 95 MB
    assert "| training, target words/s | annotated_transformer | 120 | 100 | 1.20x | 1.20 1.20 |" \
        in out
    assert "| training peak memory, MB | annotated_transformer | 90 | 88 | 1.04x | 1.12 0.95 |" \
        in out
