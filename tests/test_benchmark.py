"""scripts/benchmark.py runs end to end on a tiny job, and its ratios are its own figures'."""

import os
import re
import subprocess
import sys

import pytest

from conftest import FAIRSEQ_BREAKS_POST_LN, REPO

BENCHMARK = os.path.join(REPO, "scripts", "benchmark.py")
TINY = ["--data", "synthetic", "--train-sentences", "400", "--test-sentences", "16",
        "--preset", "tiny", "--max-tokens", "1024"]


def benchmark(*args, work):
    proc = subprocess.run([sys.executable, BENCHMARK, *TINY, "--work-dir", str(work), *args],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.skipif(FAIRSEQ_BREAKS_POST_LN, reason="fairseq 0.12.2's own transformer (post-LN) "
                    "cannot decode padded batches (fairseq #4858): the benchmark's generation "
                    "needs fairseq-fixed")
def test_the_benchmark_prints_each_ratio_from_the_figures_beside_it_and_the_cache_table(tmp_path):
    out = benchmark("--rounds", "1", "--train-updates", "10", "--gen-length", "8",
                    "--cache-lengths", "4", "--skip-ctranslate2", "--decoding-in-process",
                    work=tmp_path)
    assert re.search(r"training batches: [\d.]+% source and [\d.]+% target positions are padding",
                     out)
    rows = {}
    for line in out.splitlines():  # | label | model | ours | theirs | ratio | per-round ratios |
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 6 and cells[1] == "annotated_transformer":
            rows[cells[0]] = (float(cells[2]), float(cells[3]), float(cells[4].rstrip("x")))
    assert sorted(rows) == sorted(["training, target words/s", "generation beam 5, tokens/s",
                                   "training peak memory, MB", "generation peak memory, MB"])
    for ours, theirs, ratio in rows.values():
        assert ours > 0 and theirs > 0
        assert abs(ratio - ours / theirs) <= 0.005 + 0.5 / theirs * ratio  # medians are rounded
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
        if re.match(r"\| (annotated_transformer|transformer) \| [\d.]+ \|", line))}
    assert sorted(spent) == ["annotated_transformer", "transformer"], out[-2000:]
    for whole, in_model, rest in spent.values():
        assert 0 < in_model < whole and abs(whole - in_model - rest) <= 0.0015
    profiled = re.findall(r"\n(annotated_transformer|transformer), beam 5, 100 sentences x 8 "
                          r"tokens, profiled: [\d.]+ s of CPU time.*\n(?:  .*\n)+  \(CPU time "
                          r"in the model's calls: forward ([\d.]+) s", out)
    assert sorted(name for name, _ in profiled) == ["annotated_transformer", "transformer"]
    assert all(float(seconds) > 0 for _, seconds in profiled)


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
        profiled = re.search(rf"\n{name}, 1 steps profiled: [\d.]+ s of CPU time, matrix "
                             r"products [\d.]+ s, ([\d,.]+) GFLOP", out)
        assert profiled, name
        gflop[name] = float(profiled[1].replace(",", ""))
    # the same batch: computing the padding (about a fifth of the target positions here) costs
    # matrix products that packing saves
    assert 0 < gflop["annotated_transformer"] < gflop["annotated_transformer without packing"]


def test_step_options_without_steps_in_process_are_one_error_line():
    proc = subprocess.run([sys.executable, BENCHMARK, "--without-packing"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-1] == ("benchmark.py: error: --profile-steps and "
                                            "--without-packing go with --steps-in-process N")


def test_bf16_which_fairseq_012_runs_on_tpus_only_is_one_error_line(tmp_path):
    proc = subprocess.run([sys.executable, BENCHMARK, "--precision", "bf16", "--work-dir",
                           str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-1] == (
        "benchmark.py: error: --precision bf16: fairseq 0.12's --bf16 also switches on --tpu "
        "(fairseq-train then looks for a TPU) and fairseq-generate has no bf16; on a GPU use "
        "--precision fp16 (or fp32)")
    assert os.listdir(tmp_path) == []


def test_a_work_dir_with_files_is_one_error_line_not_a_resumed_run(tmp_path):
    (tmp_path / "annotated_transformer-round0").mkdir()
    proc = subprocess.run([sys.executable, BENCHMARK, "--work-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-1] == (
        f"benchmark.py: error: --work-dir {tmp_path} is not empty (fairseq-train would resume "
        "its checkpoints); give a new or empty directory, and --data-bin DIR to reuse prepared "
        "data")
