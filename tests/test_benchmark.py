"""annotated-benchmark (fairseq_plugin.benchmark) runs end to end on a tiny job, and its ratios are
its own figures'."""

import gc
import os
import re
import signal
import statistics
import subprocess
import sys
import time

import pytest
import torch

from conftest import (FAIRSEQ_BREAKS_POST_LN, exit_code, preprocess_reverse, reverse_data_bin,
                      running_with)

from fairseq_plugin.benchmark import child, common, data, main, memory, report, runs, steps
from fairseq_plugin.benchmark.child import Device

BENCHMARK = [sys.executable, "-m", "fairseq_plugin.benchmark"]  # annotated-benchmark
OURS, THEIRS = common.OURS, common.THEIRS

# the CPU's step peak watches storages' Python objects; torch 2.1.2's die before their storages
needs_watchable_storages = pytest.mark.skipif(
    not memory.storages_keep_their_python_object(), reason=memory.UNSUPPORTED)

TINY = ["--data", "synthetic", "--train-sentences", "400", "--test-sentences", "16",
        "--preset", "tiny", "--max-tokens", "1024"]
NO_GENERATION = pytest.mark.skipif(
    FAIRSEQ_BREAKS_POST_LN, reason="fairseq 0.12.2's own transformer (post-LN) cannot decode "
    "padded batches (fairseq #4858): the benchmark's generation needs fairseq-fixed")


def benchmark(*args, work):
    proc = subprocess.run([*BENCHMARK, *TINY, "--work-dir", str(work), *args],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def record_training_steps(monkeypatch, what):
    """A list that gets ``what(trainer)`` at each of fairseq's Trainer.train_step calls."""
    from fairseq.trainer import Trainer

    kept, train_step = [], Trainer.train_step
    monkeypatch.setattr(Trainer, "train_step", lambda self, samples, *a, **k: (
        kept.append(what(self)), train_step(self, samples, *a, **k))[1])
    return kept


@pytest.mark.main_lane  # for CI's time; the 0.12.2 lane keeps in-process steps and MFU
def test_the_benchmark_prints_each_ratio_from_the_figures_beside_it_and_the_cache_table(tmp_path):
    # of 40 test sentences the first 16 decoded (checked against fairseq-generate's count)
    data_bin = reverse_data_bin(tmp_path / "data", "--train", 400, "--valid", 50, "--test", 40)
    out = benchmark("--data-bin", str(data_bin), "--rounds", "1", "--train-updates", "20",
                    "--gen-length", "8", "--cache-lengths", "4", "--skip-ctranslate2",
                    "--decoding-in-process", "--contestants",
                    "annotated_transformer,transformer,torch-choice", work=tmp_path / "work")
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


def check_step_ratio(out, name):
    m = re.search(rf"transformer / {name}: ([\d.]+)x in all \(([\d.]+) s / ([\d.]+) s\)", out)
    assert m, out[-2000:]
    ratio, theirs, ours = float(m[1]), float(m[2]), float(m[3])  # sums printed to 1 ms
    low, high = (theirs - 0.0005) / (ours + 0.0005), (theirs + 0.0005) / (ours - 0.0005)
    assert low - 0.0005 <= ratio <= high + 0.0005


def test_steps_in_process_time_the_contestants_and_count_what_a_step_keeps_and_holds(
        tmp_path, capsys, monkeypatch):
    """Each step ratio from the sums beside it; what a training forward keeps for backward (more
    with packing off), by operator; what a step holds at its peak, the device counter's readings
    around exactly one step of each model. Where torch cannot watch storages, one line says so."""
    data_bin = data.make_data(str(tmp_path), 400, 16, 6000)  # much target padding
    stepped = record_training_steps(monkeypatch, lambda trainer: trainer.model)
    counter, readings = memory.step_peak_counter(Device()), []

    class OneStepEach:  # the device's counter, checked to read around one step each time
        def peak_of(self, work):
            before = len(stepped)
            peak = counter.peak_of(work)
            assert len(stepped) == before + 1
            readings.append((type(stepped[-1]).__name__, peak / 2 ** 20))
            return peak

    if counter is not None:
        monkeypatch.setattr(steps, "step_peak_counter", lambda device: OneStepEach())
    main.main(["--data-bin", data_bin, "--preset", "tiny", "--max-tokens", "1024",
               "--steps-in-process", "2", "--contestants",
               "annotated_transformer,transformer,without-packing"])
    out = capsys.readouterr().out
    assert "2 training steps each, alternated: annotated_transformer median" in out, out[-2000:]
    check_step_ratio(out, "annotated_transformer")
    check_step_ratio(out, "annotated_transformer without packing")
    # the activations kept for backward, with the ratio of the figures beside it
    kept = re.search(r"\nkept for backward by one training forward of the timed batch with "
                     r"the most target padding \(([\d.]+)% target padding, \d+ positions\) "
                     r"\(distinct storages, parameters excluded\): annotated_transformer "
                     r"([\d.]+) MiB, transformer ([\d.]+) MiB, annotated_transformer without "
                     r"packing ([\d.]+) MiB; annotated_transformer / transformer: ([\d.]+)x\n",
                     out)
    assert kept, out[-2000:]
    padding, ours, theirs, unpacked, ratio = map(float, kept.groups())
    assert ours > 0 and theirs > 0 and abs(ratio - ours / theirs) <= 0.006
    # the same batch with packing off keeps the padding's activations too
    assert padding > 5 and ours < unpacked
    # then by the operators that made it, and the same for the batch with the most positions
    assert "\n| made by (grad_fn, dtype) | annotated_transformer, MiB | transformer, MiB |\n" in out
    assert ("\nkept for backward by one training forward of the timed batch with the most "
            "positions (") in out
    if not memory.storages_keep_their_python_object():
        assert f"\n(no step peaks on the CPU: {memory.UNSUPPORTED})\n" in out
        assert "held at its peak" not in out
        return
    # what one step holds at its peak, counted by storage: at least what the forward keeps for
    # backward, less the gradients of the step before, freed first
    held = re.search(r"\nheld at its peak by one training step of that batch \(forward, "
                     r"backward, update\), beyond what was allocated before it: "
                     r"annotated_transformer ([\d.]+) MiB, transformer ([\d.]+) MiB, "
                     r"annotated_transformer without packing ([\d.]+) MiB; "
                     r"annotated_transformer / transformer: ([\d.]+)x\n", out)
    assert held, out[-2000:]
    for peak, kept_mib in zip(map(float, held.groups()[:3]), (ours, theirs, unpacked)):
        assert peak >= kept_mib - 2.0  # the tiny models' gradients: 1.6 MiB
    assert abs(float(held[4]) - float(held[1]) / float(held[2])) <= 0.006
    # two batches (the most target padding, the most positions), each contestant's step on each
    models = ["AnnotatedTransformerModel", "TransformerModel", "AnnotatedTransformerModel"]
    assert [name for name, _ in readings] == models * 2
    assert held.groups()[:3] == tuple(f"{m:.1f}" for _, m in readings[:3])
    monkeypatch.undo()
    monkeypatch.setattr(memory, "storages_keep_their_python_object", lambda: False)
    with pytest.raises(RuntimeError, match=r"^storage_peak: this torch's storages do not keep "):
        memory.StoragePeakCounter().peak_of(lambda: None)
    steps.steps_in_process(data_bin, common.contestants("annotated_transformer,transformer"),
                           "tiny", 1024, 1, Device())
    out = capsys.readouterr().out
    assert f"\n(no step peaks on the CPU: {memory.UNSUPPORTED})\n" in out
    assert "\nkept for backward by one training forward" in out and "held at its peak" not in out


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


def test_a_max_tokens_sweep_warms_each_model_up_on_an_epoch_and_tables_each_size(
        tmp_path, monkeypatch, capsys):
    """--max-tokens A,B with --steps-in-process N: each size's steps in turn, then a table whose
    figures are the per-size lines'; --warm-up-epoch: every model first trains on a whole epoch
    of that size's batches, untimed; more steps than an epoch has batches go on into the next."""
    data_bin = reverse_data_bin(tmp_path / "data", "--train", 300, "--valid", 20, "--test", 10)
    epoch = {size: len(steps.fairseq_trainer(common.training_flags(
        str(data_bin), common.CONTESTANTS[OURS], "tiny", size, Device())).get_train_iterator(1))
        for size in (512, 2048)}
    assert epoch[512] > epoch[2048] >= 2
    models = record_training_steps(monkeypatch, lambda trainer: type(trainer.model).__name__)
    monkeypatch.setattr(steps, "print_memory", lambda *args: None)  # (its steps are not timed)
    n = epoch[2048] + 1  # at 2048, into the second epoch
    main.main(["--data-bin", str(data_bin), "--preset", "tiny", "--max-tokens", "512,2048",
               "--steps-in-process", str(n), "--warm-up-epoch"])
    out = capsys.readouterr().out
    assert (models.count("AnnotatedTransformerModel") == models.count("TransformerModel")
            == epoch[512] + epoch[2048] + 2 * n)
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


def test_a_ratio_row_gives_the_median_of_the_per_round_ratios_not_the_ratio_of_medians():
    row = report.ratio_row("train", "ours", [100, 300], [200, 100])
    # medians 200 and 150 (ratio 1.33); per-round ratios 0.5 and 3.0, their median 1.75
    assert row == "| train | ours | 200 | 150 | 1.75x | 0.50 3.00 |"
    # rounds alternate the order, so that an even number of them balances it
    orders = [common.alternated(["A", "B", "C"], i) for i in range(4)]
    assert orders == [["A", "B", "C"], ["C", "B", "A"], ["A", "B", "C"], ["C", "B", "A"]]
    for model in "ABC":  # over an even number of rounds every place is each model's equally often
        places = sorted(order.index(model) for order in orders)
        assert places == sorted(2 - p for p in places)


@pytest.mark.parametrize("dataset_impl", ["mmap", "cached"])
def test_decoding_part_of_a_test_set_takes_its_first_sentences(tmp_path, dataset_impl):
    from fairseq.data import Dictionary, data_utils

    data_bin = reverse_data_bin(tmp_path, "--train", 50, "--valid", 10, "--test", 30,
                                preprocess=["--dataset-impl", dataset_impl])
    subset = data.first_test_sentences(str(data_bin), 7, str(tmp_path / "work"))
    for lang in ("src", "tgt"):
        d = Dictionary.load(os.path.join(data_bin, f"dict.{lang}.txt"))
        full, first = (data_utils.load_indexed_dataset(os.path.join(folder, f"test.src-tgt.{lang}"),
                                                       d) for folder in (str(data_bin), subset))
        assert len(full) == 30 and len(first) == 7
        if dataset_impl == "cached":  # (read only what was prefetched)
            full.prefetch(range(7))
        assert all(first[i].tolist() == full[i].tolist() for i in range(7))


GIVE_CONTESTANTS = ("give annotated_transformer, transformer, torch-choice, without-packing, "
                    "compiled or before=PLUGIN_DIR (a checkout's fairseq_plugin folder), "
                    "separated by commas")


@pytest.mark.main_lane  # the benchmark's own option checks, whatever fairseq's version
@pytest.mark.parametrize("args, message", [
    (["--rounds", "0"], "argument --rounds: '0': give whole numbers of at least 1, separated by "
                        "commas, e.g. 25,50,100"),
    (["--rounds", "2,3"], "argument --rounds: '2,3': give one whole number of at least 1"),
    (["--cache-lengths", "25,abc"], "argument --cache-lengths: '25,abc': give whole numbers of "
                                    "at least 1, separated by commas, e.g. 25,50,100"),
    (["--warm-up-epoch"], "--warm-up-epoch goes with --steps-in-process N"),
    (["--data-bin", "{tmp}/missing"], "--data-bin {tmp}/missing: no such folder; give one made by "
                                      "fairseq-preprocess or annotated-prepare"),
    (["--data-bin", "{tmp}"], "--data-bin {tmp} has no test split (test.*) to decode; binarise "
                              "one with --testpref"),
    (["--contestants", "annotated_transformer,transformer,fast"],
     "argument --contestants: 'fast': " + GIVE_CONTESTANTS),
    (["--contestants", "annotated_transformer,before={tmp}/missing"],
     "argument --contestants: 'before={tmp}/missing': " + GIVE_CONTESTANTS),
    (["--contestants", "annotated_transformer,compiled"],
     "argument --contestants: 'annotated_transformer,compiled': annotated_transformer and "
     "transformer are both needed (the ratios are between them), each contestant once"),
    (["--contestants", "annotated_transformer,transformer,before={tmp}", "--steps-in-process",
      "2"], "--steps-in-process: before=PLUGIN_DIR runs in fairseq's commands only (two plugins "
            "cannot register in one process)"),
    (["--work-dir", "{tmp}/a_file"], "--work-dir {tmp}/a_file is a file; give a new or empty "
                                     "directory"),
    (["--work-dir", "{tmp}"], "--work-dir {tmp} is not empty (fairseq-train would resume its "
                              "checkpoints); give a new or empty directory, and --data-bin DIR "
                              "to reuse prepared data"),
    (["--skip-generation", "--decoding-in-process"], "--skip-generation --decoding-in-process: "
                                                     "the second decodes; leave out one"),
    (["--max-tokens", "8192,16384"], "--max-tokens 8192,16384: several sizes (a sweep) go with "
                                     "--steps-in-process N; give one size for the rounds"),
])
def test_bad_benchmark_options_are_one_error_line_before_any_work(args, message, tmp_path,
                                                                  capsys):
    """In this process (the command's start-up, a few seconds each, is paid once): the exit status
    and the last line are those of the command (annotated-benchmark)."""
    from fairseq_plugin.benchmark.main import main

    (tmp_path / "a_file").write_text("")
    stop = exit_code(main, [a.format(tmp=tmp_path) for a in args])
    assert stop == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == "annotated-benchmark: error: " + message.format(tmp=tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["a_file"]


class StandInAllocator:
    """torch.cuda's counters as child.PeakCounter uses them: ``use`` makes a block of n_bytes at
    an address, or without n_bytes frees the one there."""

    def __init__(self):
        self.allocated, self.peak, self.blocks, self.synchronize = 0, 0, {}, lambda: None
        self.memory_allocated, self.max_memory_allocated = lambda: self.allocated, lambda: self.peak

    def reset_peak_memory_stats(self):
        self.peak = self.allocated

    def use(self, addr, n_bytes=None):
        n_bytes = -self.blocks.pop(addr) if n_bytes is None else self.blocks.setdefault(addr,
                                                                                         n_bytes)
        self.allocated += n_bytes
        self.peak = max(self.peak, self.allocated)


def test_the_gpu_peak_outlasts_fairseqs_resets_of_the_counter(monkeypatch, capsys):
    """fairseq's trainer resets torch.cuda's peak counter after every step; what the benchmark
    reads (child.PeakCounter, set up in every GPU process before fairseq runs) is still the
    most allocated at once over the whole command, and says when it came."""
    at_exit = []
    monkeypatch.setattr(child.atexit, "register", at_exit.append)
    cuda = StandInAllocator()
    cuda.use(1, 100 * 2 ** 20)  # before switch_on: counted only as what stays allocated
    cuda.use(2, 50 * 2 ** 20)
    cuda.use(2)
    counter = child.switch_on(cuda)
    assert counter.where() == "(no training step)"  # e.g. fairseq-generate
    for step_peak in (300, 500, 200):  # three training steps, the counter reset after each
        cuda.use(3, step_peak * 2 ** 20)
        cuda.use(3)
        cuda.reset_peak_memory_stats()  # what fairseq calls: torch.cuda.reset_peak_memory_stats
    assert cuda.max_memory_allocated() == 100 * 2 ** 20  # the counter alone lost the steps
    assert counter.peak() == 600 * 2 ** 20
    at_exit[0]()
    assert capsys.readouterr().out == ("cuda peak MB 600.0 in training step 2 of 3; 100.0 MB "
                                       "allocated between steps\n")
    cuda.use(4, 700 * 2 ** 20)  # saving, after the last step
    assert counter.where() == "after the last training step; 100.0 MB allocated between steps"
    cuda.use(4)

    def step():  # around one step: from what is allocated at its start, the reset inside
        cuda.use(5, 250 * 2 ** 20)
        cuda.use(5)
        cuda.reset_peak_memory_stats()

    assert counter.peak_of(step) == 250 * 2 ** 20  # beyond the 100 MiB allocated before it
    out = f"log\n{child.PRINTED} 600.0 in training step 2 of 3; 100.0 MB allocated\nend\n"
    assert Device("cuda", "fp16").peak(out, 0) == (600.0, "in training step 2 of 3; 100.0 MB "
                                                          "allocated")
    assert Device().peak(out, 7.0) == (7.0, "")
    command = Device("cuda", "fp16").command(["fairseq-train", "x"])
    setup = command[command.index("-c") + 1]  # the child's code before fairseq's script
    # the child imports child.py by its path, not through the package (whose __init__ would
    # register the plugin before fairseq imports its --user-dir), and edits no sys.path
    here = os.path.dirname(child.__file__)
    assert (setup.index(repr(os.path.join(here, "child.py"))) < setup.index("child.switch_on();")
            < setup.index("child.run(")) and command[-2:] == ["fairseq-train", "x"]
    assert "sys.path" not in setup and "fairseq_plugin" not in setup.replace(here, "")
    assert Device().command(["fairseq-train"]) == ["fairseq-train"]  # nothing to set up


@needs_watchable_storages
def test_the_cpu_peak_counts_each_storage_from_the_operator_that_makes_it_to_its_freeing(
        monkeypatch):
    """memory.StoragePeakCounter, the CPU's child.PeakCounter: a storage counts from the operator
    that made it until it is freed, backward included; views and in-place results add nothing
    (also of a tensor not among Python's objects); one freed in the work counts negative."""
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

    assert memory.StoragePeakCounter().peak_of(work) == 12000
    x = torch.ones(1000, requires_grad=True)
    # the product, 4000 bytes, goes after the sum; x's gradient from two products of 4000
    assert memory.StoragePeakCounter().peak_of(lambda: (x * x).sum().backward()) >= 8000
    assert float(x.grad[0]) == 2.0
    monkeypatch.setattr(memory.gc, "get_objects", lambda: [])  # (a tensor only C++ holds)
    assert memory.StoragePeakCounter().peak_of(
        lambda: (x.data.mul_(2), x.data[:500].add_(1), x.data.view(10, 100).t_())) == 0


# fairseq CLI stand-ins: one that finishes, then aborts in Python's shutdown (as fp16
# fairseq-train did on an H100: child.py), and two that fail
STAND_INS = {"finished-then-aborted": "import atexit, os; print('done training'); "
                                      "atexit.register(os.abort)",
             "aborted": "import os; print('training'); os.abort()",
             "failed": "import sys; print('training'); sys.exit(1)"}


def test_a_command_that_finished_keeps_its_figures_through_an_abort_in_shutdown_and_says_so(
        tmp_path, capsys):
    """A child that ends its work (exit status 0) and then aborts while Python shuts down keeps
    its output, with a note and a count; one that aborts or fails before its end is an error."""
    child.ABORTED_AFTER_FINISHING.clear()
    device = Device("cpu", "bf16")  # a child with set-up code (bf16), as on a GPU
    for name, code in STAND_INS.items():
        (tmp_path / name).write_text(code)
    out, _, _ = child.run_measured([tmp_path / "finished-then-aborted"], device)
    assert "done training" in out and child.FINISHED in out
    assert "finished-then-aborted finished (exit status 0), then aborted" in (
        capsys.readouterr().out)
    for name in ("aborted", "failed"):
        with pytest.raises(SystemExit, match=f"benchmark: error: {name} failed"):
            child.run_measured([tmp_path / name], device)
    assert child.ABORTED_AFTER_FINISHING == ["finished-then-aborted"]


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


@NO_GENERATION
def test_stopped_by_sigterm_the_benchmark_reports_its_complete_rounds_with_the_other_models(
        tmp_path):
    """SIGTERM (a timeout's) in round 2 prints round 1's table, stops fairseq's command and ends
    in one error line; each round has the contestants asked for (torch-choice: trained and decoding
    with --fused-attention-backends torch; without-packing: --no-packing). bf16: fairseq 0.12's
    --bf16 also switches on --tpu, switched back off in training (the checkpoint says bf16, not
    tpu); fairseq-generate, which has no bf16, decodes the checkpoint turned to bf16."""
    data_bin = reverse_data_bin(tmp_path / "data", "--train", 400, "--valid", 50, "--test", 16)
    proc = subprocess.Popen(
        [*BENCHMARK, *TINY, "--data-bin", str(data_bin), "--rounds", "2", "--precision", "bf16",
         "--train-updates", "10", "--gen-length", "8", "--skip-ctranslate2", "--skip-cache",
         "--contestants", "annotated_transformer,transformer,torch-choice,without-packing",
         "--work-dir", str(tmp_path / "work")],
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
    assert not running_with(str(tmp_path / "work"))  # fairseq's command was stopped too
    assert err.splitlines()[-1] == ("benchmark: stopped after 1 of 2 rounds (SIGTERM); the table "
                                    "above gives those"), err[-2000:]
    assert "benchmark: stopped (SIGTERM) in round 2 of 2; the tables give the 1 complete rounds" \
        in out
    assert "| medians of 1 rounds |" in out and ", cpu bf16, data " in out
    assert "| generation beam 5, tokens/s | annotated_transformer |" in out
    # 10 updates logged every 5: not every run logged an interval after its first epoch
    assert "(no row for training after the first epoch: not every training command" in out
    assert "| training after the first epoch" not in out
    rows = [[c.strip() for c in line.strip("| \n").split("|")] for line in out.splitlines()
            if line.startswith("| training, target words/s |")]
    assert [r[1] for r in rows] == ["annotated_transformer", "annotated_transformer torch-choice",
                                    "annotated_transformer without packing"]
    assert all(len(r[5].split()) == 1 for r in rows)  # one ratio: round 1's
    saved = {name: torch.load(tmp_path / "work" / f"{name}-round0" / "checkpoint_last.pt",
                              weights_only=False)["cfg"]
             for name in ("annotated_transformer", "annotated_transformer-torch-choice",
                          "annotated_transformer-without-packing", "transformer")}
    assert all((cfg["common"]["bf16"], cfg["common"]["tpu"]) == (True, False)
               for cfg in saved.values())
    saved = {name: cfg["model"] for name, cfg in saved.items() if name != "transformer"}
    assert saved["annotated_transformer"]["fused_attention_backends"] == "no-cudnn"
    assert saved["annotated_transformer-torch-choice"]["fused_attention_backends"] == "torch"
    assert [saved[name]["no_packing"] for name in saved] == [False, False, True]


def test_training_speed_after_the_first_epoch_leaves_out_the_first_epoch_and_its_boundary():
    """fairseq-train's json intervals: the whole run's median skips the first; the later median
    takes epochs after the first, less the one crossing into them, or None; too few: one line."""

    def log(*intervals):  # (epoch, wps) each, as fairseq-train's train_inner lines
        return "\n".join(f'2026-11-27 | INFO | train_inner | {{"epoch": {e}, "update": 1.5, '
                         f'"wps": "{w}", "ups": "1.0"}}' for e, w in intervals) + "\nother line"

    assert runs.training_speeds(log((1, 5), (1, 10), (1, 20), (2, 30), (2, 100), (3, 200),
                                     (3, 300))) == (65, 200)
    assert runs.training_speeds(log((1, 5), (1, 10), (1, 20), (2, 30))) == (20, None)
    with pytest.raises(SystemExit, match="too few logged intervals; raise --train-updates"):
        runs.training_speeds(log((1, 5)))


def test_model_flops_count_each_stacks_layers_the_output_projection_and_the_length_ratio(
        tmp_path):
    """report.model_flops: 6 x (N_enc x S/T + N_dec + d_model x V), N counted from each model's
    own layers (against a count by hand for the tiny preset), S/T from the data's real lengths."""
    (raw := tmp_path / "raw").mkdir()
    for split in ("train", "valid", "test"):
        (raw / f"{split}.src").write_text("a b c d e f\n" * 20)  # 6 tokens + EOS
        (raw / f"{split}.tgt").write_text("a b\n" * 20)  # 2 tokens + EOS
    data_bin = preprocess_reverse(raw, tmp_path / "bin")
    assert report.source_per_target(str(data_bin)) == pytest.approx(7 / 3)
    layers, d, ff, _ = common.PRESETS["tiny"]
    attention, feed_forward, norm = 4 * (d * d + d), d * ff + ff + ff * d + d, 2 * d
    encoder_layer = attention + feed_forward + 2 * norm
    decoder_layer = 2 * attention + feed_forward + 3 * norm
    contestants = common.contestants("annotated_transformer,transformer,compiled")
    flops = report.model_flops(str(data_bin), contestants, "tiny", 1024, Device(), 1.0)
    for c in contestants:
        cfg, task = common.fairseq_setup(common.training_flags(str(data_bin), c, "tiny", 1024,
                                                               Device()))
        model = task.build_model(cfg.model)
        vocabulary = len(model.decoder.dictionary)
        assert report.layer_parameters(model) == (layers * encoder_layer, layers * decoder_layer,
                                                  d * vocabulary), c.name
        assert flops[c.name] == pytest.approx(
            6 * (layers * encoder_layer * 7 / 3 + layers * decoder_layer + d * vocabulary))
    assert flops["peak"] == 1e12


def test_the_device_peak_comes_from_the_table_by_name_the_flag_or_the_cpus_measured_rate():
    def gpu_peak(name, precision):
        return report.device_peak(Device("cuda", precision), gpu_name=name)[0]

    assert gpu_peak("NVIDIA H100 80GB HBM3", "bf16") == pytest.approx(989.4e12)
    assert gpu_peak("NVIDIA H100 PCIe", "fp16") == pytest.approx(756e12)
    assert gpu_peak("NVIDIA H200", "fp32") == pytest.approx(66.9e12)
    assert gpu_peak("NVIDIA GeForce RTX 4090", "bf16") is None
    assert report.device_peak(Device(), 2.5) == (2.5e12, "given by --peak-tflops")
    peak, source = report.device_peak(Device())
    assert 1e8 < peak < 1e14 and source.startswith("the CPU's measured fp32 matrix-product rate")
    assert report.mfu_line(1e9, 2000, 4e12) == "2 TFLOP/s, 50.00% MFU"
    assert report.mfu_line(1.23456e9, 2000, None) == "2.469 TFLOP/s"
    # the fastest product over a time window, not ten in a row: a shared machine's short slow
    # spell must not set the peak (it once read below the rate training then reached)
    start = time.perf_counter()
    assert 1e8 < report.measured_cpu_peak(size=64, seconds=0.3) < 1e14
    assert time.perf_counter() - start >= 0.3
