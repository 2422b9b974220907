"""annotated-benchmark-learning: both architectures trained by one command line in which only
--arch differs, and a table of means over seeds made from what the runs wrote. (The figures of
docs/benchmarks.md come from its full run; no test asserts an accuracy.)"""

import json
import re

import pytest

from fairseq_plugin.cli import learning, reverse_task
from fairseq_plugin.errors import PluginError


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


@pytest.mark.main_lane
def test_a_run_trains_both_models_per_seed_and_tables_the_means_of_what_they_wrote(tmp_path,
                                                                                    capsys):
    """Two seeds of one epoch on 300 pairs: four runs, the order of the two models alternating
    by seed; each figure in the table is the mean of the runs' results.json figures, which are
    what fairseq wrote (its validation nll_loss, "done training in")."""
    work = tmp_path / "learning"
    learning.main(["--work-dir", str(work), "--tasks", "sort", "--seeds", "2", "--epochs", "1",
                   "--train-size", "300"])
    out = capsys.readouterr().out
    results = json.loads((work / "results.json").read_text())
    assert [(r["arch"], r["seed"]) for r in results] == [
        ("annotated_transformer", 1), ("transformer", 1),
        ("transformer", 2), ("annotated_transformer", 2)]
    for r in results:
        log = (work / "sort" / f"{r['arch']}-seed{r['seed']}" / "train.log").read_text()
        logged = re.findall(r"valid on 'valid' subset \|.*?\| nll_loss ([0-9.]+)", log)
        assert logged and r["valid_nll"] == min(map(float, logged)), (r, logged)
        model = {"annotated_transformer": "AnnotatedTransformerModel",
                 "transformer": "TransformerModel"}[r["arch"]]
        assert f"| fairseq_cli.train | model: {model}\n" in log, log[:3000]
        assert 0.0 <= r["exact_match"] <= 1.0 and r["train_seconds"] > 0
    for arch in learning.ARCHS:
        runs = [r for r in results if r["arch"] == arch]
        mean = sum(r["valid_nll"] for r in runs) / 2
        row = re.search(rf"\| sort \| {arch} \| 2 \| ([0-9.]+) ± [0-9.]+ \| ([0-9.]+) ± ", out)
        assert row, out
        assert float(row[2]) == pytest.approx(mean, abs=5e-4)
        assert float(row[1]) == pytest.approx(sum(r["exact_match"] for r in runs) / 2, abs=5e-4)
    # a second run into the same folder is refused (one line), not mixed with the first
    with pytest.raises(PluginError, match=r"annotated_transformer-seed1 exists \(an earlier"):
        learning.main(["--work-dir", str(work), "--tasks", "sort", "--seeds", "1", "--epochs",
                       "1", "--train-size", "300"])
