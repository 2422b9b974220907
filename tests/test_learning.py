"""annotated-benchmark-learning: both architectures trained by one command line in which only
--arch differs, and a table of means over seeds made from what the runs wrote. (The figures of
docs/benchmarks.md come from its full run; no test asserts an accuracy.)"""

import json
import re

import pytest

from conftest import exit_code
from fairseq_plugin.cli import learning, reverse_task


def test_the_two_models_command_lines_differ_in_the_architecture_alone():
    ablation = ["--encoder-learned-pos", "--decoder-learned-pos"]  # --flags: for both
    a, b = (learning.train_command(arch, "DATA", "SAVE", 3, 7, ablation)
            for arch in learning.ARCHS)
    differing = [(x, y) for x, y in zip(a, b) if x != y]
    assert len(a) == len(b) and differing == [learning.ARCHS], differing
    assert a[-2:] == b[-2:] == ablation
    for flag in ("--encoder-normalize-before", "--decoder-normalize-before",
                 "--share-all-embeddings"):
        assert flag in a  # fairseq's transformer is post-LN and untied unless told


def test_sort_task_targets_are_the_sources_sorted(tmp_path):
    reverse_task.main([str(tmp_path), "--train", "50", "--valid", "5", "--test", "5"], task="sort")
    sources = (tmp_path / "train.src").read_text().splitlines()
    targets = (tmp_path / "train.tgt").read_text().splitlines()
    assert len(sources) == 50 and any(s != t for s, t in zip(sources, targets))
    assert all(sorted(s.split()) == t.split() for s, t in zip(sources, targets))


def test_seeds_alternate_the_order_and_the_table_gives_each_models_mean_and_sd():
    assert [learning.order(seed) for seed in (1, 2, 3)] == [
        learning.ARCHS, learning.ARCHS[::-1], learning.ARCHS]
    runs = [{"task": "sort", "arch": arch, "seed": seed, "exact_match": match, "valid_nll": nll,
             "train_seconds": seconds}
            for arch, seed, match, nll, seconds in (
                ("annotated_transformer", 1, 0.5, 0.30, 90.0),
                ("transformer", 1, 0.6, 0.20, 100.0),
                ("annotated_transformer", 2, 0.7, 0.10, 110.0),
                ("transformer", 2, 0.6, 0.40, 120.0))]
    assert learning.table(runs, ["sort"]).splitlines()[2:] == [
        "| sort | annotated_transformer | 2 | 0.600 ± 0.141 | 0.200 ± 0.141 | 100 ± 14 |",
        "| sort | transformer | 2 | 0.600 ± 0.000 | 0.300 ± 0.141 | 110 ± 14 |"]


@pytest.mark.main_lane
def test_a_run_tables_what_fairseq_logged_for_each_model(tmp_path, capsys, monkeypatch):
    """One seed of one epoch on 300 pairs (the slowest part: four fairseq commands): each run's
    figures in results.json are what fairseq wrote (the best validation nll_loss, "done
    training in"), each log names its model, and the table shows them."""
    # a model this untrained never ends a hypothesis: fairseq-generate's 200 steps each, most of
    # this test's time; its answers are checked only to lie in [0, 1], so they end by 14 tokens
    generate_command = reverse_task.generate_command
    monkeypatch.setattr(reverse_task, "generate_command", lambda *args: [
        *generate_command(*args), "--max-len-a", "0", "--max-len-b", "14"])
    work = tmp_path / "learning"
    learning.main(["--work-dir", str(work), "--tasks", "sort", "--seeds", "1", "--epochs", "1",
                   "--train-size", "300"])
    out = capsys.readouterr().out
    results = json.loads((work / "results.json").read_text())
    assert [(r["arch"], r["seed"]) for r in results] == [(arch, 1) for arch in learning.ARCHS]
    for r in results:
        log = (work / "sort" / f"{r['arch']}-seed1" / "train.log").read_text()
        logged = re.findall(r"valid on 'valid' subset \|.*?\| nll_loss ([0-9.]+)", log)
        assert logged and r["valid_nll"] == min(map(float, logged)), (r, logged)
        seconds = re.findall(r"done training in ([0-9.]+) seconds", log)
        assert seconds and r["train_seconds"] == float(seconds[-1]) > 0
        model = {"annotated_transformer": "AnnotatedTransformerModel",
                 "transformer": "TransformerModel"}[r["arch"]]
        assert f"| fairseq_cli.train | model: {model}\n" in log, log[:3000]
        assert 0.0 <= r["exact_match"] <= 1.0
        assert (f"| sort | {r['arch']} | 1 | {r['exact_match']:.3f} ± 0.000 | "
                f"{r['valid_nll']:.3f} ± 0.000 | {r['train_seconds']:.0f} ± 0 |") in out, out
    # a second run into the same folder is refused (one line), not mixed with the first
    refused = exit_code(learning.main,
                        ["--work-dir", str(work), "--tasks", "sort", "--seeds", "1", "--epochs",
                       "1", "--train-size", "300"])
    assert str(refused) == (
        f"annotated-benchmark-learning: error: {work}/sort/annotated_transformer-seed1 exists (an "
        f"earlier run's); give a new --work-dir or delete it")
