"""annotated-prepare at scale (fairseq_plugin/cli/streaming.py): the same bytes for any number
of workers, memory that does not grow with the corpus, BPE from a sample, sharded data-bins
fairseq trains one shard an epoch, and a rerun that knows an interrupted preparation."""

import gzip
import os
import tracemalloc

import pytest

from conftest import PLUGIN_DIR, cli, running_with
from fairseq_plugin.cli import prepare, streaming
from fairseq_plugin.cli.prepare import Preparation

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUNDLED = os.path.join(REPO, "examples", "tatoeba", "data")
SPLITS = {"train": "train", "valid": "valid", "test": "test"}


def sample_lines(lang, n):
    with gzip.open(os.path.join(BUNDLED, f"train.{lang}.gz"), "rt", encoding="utf-8") as f:
        return [next(f) for _ in range(n)]


def raw_corpus(folder, train_pairs, copies=1):
    """The bundled sample's first ``train_pairs`` pairs, ``copies`` times over, as train; its
    next 50 as valid and test."""
    os.makedirs(folder, exist_ok=True)
    for lang in ("de", "en"):
        lines = sample_lines(lang, train_pairs + 100)
        with open(os.path.join(folder, f"train.{lang}"), "w", encoding="utf-8") as f:
            f.writelines(lines[:train_pairs] * copies)
        for split, part in (("valid", lines[-100:-50]), ("test", lines[-50:])):
            with open(os.path.join(folder, f"{split}.{lang}"), "w", encoding="utf-8") as f:
                f.writelines(part)
    return str(folder)


def tree(folder):
    """Every file under ``folder`` but the logs (which name the folder), with its bytes."""
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            if not name.endswith(".log"):
                path = os.path.join(root, name)
                with open(path, "rb") as f:
                    out[os.path.relpath(path, folder)] = f.read()
    return out


def test_the_same_bytes_for_one_and_two_workers_and_small_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(streaming, "CHUNK_LINES", 300)  # several chunks in flight
    raw = raw_corpus(tmp_path / "raw", 1500)
    for workers in (1, 2):
        prepare.prepare(Preparation(raw, str(tmp_path / f"w{workers}"), "de", "en", SPLITS, 500,
                        workers=workers))
    one, two = tree(tmp_path / "w1"), tree(tmp_path / "w2")
    assert sorted(one) == sorted(two) and "train.de-en.de.bin" in one
    assert [name for name in one if one[name] != two[name]] == []
    assert [n for n in os.listdir(tmp_path) if ".tokenised-" in n] == []  # (stage files gone)


def stages_peak(raw, dest, langs=("de", "en")):
    """Peak bytes Python allocates in this process while it tokenises a corpus, and while it
    applies BPE, in one worker (this process). (Learning BPE is given the word counts only: its
    memory is the vocabulary's.)"""
    paths = [os.path.join(raw, f"train.{lang}") for lang in langs]
    found = streaming.scan(paths)
    os.makedirs(dest)
    outs = [os.path.join(dest, f"tok.{lang}") for lang in langs]
    split = streaming.Split("train", paths, found.kept, drop_empty=True)
    with streaming.workers(1) as workers:
        tracemalloc.start()
        try:
            counts = streaming.tokenise(split, outs, langs, workers, count_lines=found.kept)
            peak = tracemalloc.get_traced_memory()[1]
            codes = streaming.learn_bpe(counts, 300, "learn BPE")
            tracemalloc.reset_peak()
            for out in outs:
                streaming.apply_bpe(codes, out, out + ".bpe", found.kept, workers, "BPE")
            return max(peak, tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()


@pytest.mark.main_lane  # (the plugin's own code, whatever fairseq's version)
def test_memory_does_not_grow_with_the_corpus(tmp_path, monkeypatch):
    """16 copies of a corpus: 16 times the text, the same vocabulary."""
    monkeypatch.setattr(streaming, "CHUNK_LINES", 200)
    stages_peak(raw_corpus(tmp_path / "warm", 50), str(tmp_path / "warm-out"))  # imports
    once = stages_peak(raw_corpus(tmp_path / "x1", 400), str(tmp_path / "o1"))
    sixteen = stages_peak(raw_corpus(tmp_path / "x16", 400, copies=16), str(tmp_path / "o16"))
    text = os.path.getsize(tmp_path / "x16" / "train.de") + os.path.getsize(
        tmp_path / "x16" / "train.en")
    print(f"peak Python allocations: 1x {once / 2**20:.2f} MiB, 16x {sixteen / 2**20:.2f} MiB "
          f"(16x text: {text / 2**20:.2f} MiB)")
    assert sixteen < 1.25 * once
    assert sixteen - once < 0.5 * text  # holding the text would add several times its size


@pytest.mark.main_lane  # (the plugin's own code, whatever fairseq's version)
def test_bpe_from_a_sample_is_bpe_learnt_from_those_lines(tmp_path):
    raw = raw_corpus(tmp_path / "raw", 1000)
    first = raw_corpus(tmp_path / "first", 300)
    sampled = prepare.prepare(Preparation(raw, str(tmp_path / "sampled"), "de", "en", SPLITS, 400,
                              workers=1, bpe_sample_lines=300))
    prepare.prepare(Preparation(first, str(tmp_path / "alone"), "de", "en", SPLITS, 400, workers=1))
    assert sampled["bpe_sample_lines"] == 300 and sampled["splits"]["train"] == 1000
    assert (tmp_path / "sampled" / "bpe.codes").read_text() == \
        (tmp_path / "alone" / "bpe.codes").read_text()


def test_shards_share_one_dictionary_and_train_one_shard_an_epoch(tmp_path):
    raw = raw_corpus(tmp_path / "raw", 600)
    dest = tmp_path / "bin"
    settings = prepare.prepare(Preparation(
        raw, str(dest), "de", "en", SPLITS, 300, workers=2, shards=2))
    assert settings["data"] == f"{dest / 'shard0'}:{dest / 'shard1'}"
    dictionary = (dest / "dict.de.txt").read_bytes()
    for shard in ("shard0", "shard1"):
        assert (dest / shard / "dict.de.txt").read_bytes() == dictionary
        assert (dest / shard / "dict.en.txt").read_bytes() == dictionary
    assert (dest / "shard0" / "valid.de-en.de.bin").exists()
    assert (dest / "test.de-en.de.bin").exists()  # DEST itself serves evaluation
    proc = cli("fairseq-train", settings["data"], "--user-dir", PLUGIN_DIR, "--arch",
               "annotated_transformer_tiny", "--share-all-embeddings", "--optimizer", "adam",
               "--lr", "1e-3", "--max-tokens", "2000", "--max-epoch", "2", "--cpu",
               "--save-dir", str(tmp_path / "ckpt"), "--no-save", "--num-workers", "0")
    loaded = [line.split("loaded ")[1] for line in (proc.stdout + proc.stderr).splitlines()
              if "loaded " in line and "train.de-en.de" in line]
    # epoch 1 on shard 0, epoch 2 on shard 1 (then fairseq readies epoch 3's, shard 0 again)
    assert loaded[:2] == [f"300 examples from: {dest / 'shard0' / 'train.de-en.de'}",
                          f"300 examples from: {dest / 'shard1' / 'train.de-en.de'}"], loaded


def test_an_interrupted_preparation_is_named_on_the_rerun(tmp_path):
    raw = raw_corpus(tmp_path / "raw", 300)
    dest = tmp_path / "bin"
    dest.mkdir()
    (dest / prepare.MARKER).write_text("")  # what a stopped run leaves: no prepare.json
    (dest / "text").mkdir()
    with pytest.raises(prepare.PrepareError, match=r"holds an unfinished preparation \(it was "
                                                   r"interrupted\); pass --force to prepare it "
                                                   r"again, or choose another --dest"):
        prepare.prepare(Preparation(raw, str(dest), "de", "en", SPLITS, 300, workers=1))
    prepare.prepare(Preparation(raw, str(dest), "de", "en", SPLITS, 300, workers=1, force=True))
    assert (dest / "prepare.json").exists()


def test_a_plain_and_a_gzipped_copy_of_one_side_are_refused_as_ambiguous(tmp_path):
    raw = raw_corpus(tmp_path / "raw", 100)
    with gzip.open(os.path.join(raw, "train.de.gz"), "wt", encoding="utf-8") as f:
        f.write("anders\n")
    with pytest.raises(prepare.PrepareError, match=r"both .*train.de and .*train.de.gz are "
                                                   r"there: which is the corpus\? Move one away"):
        prepare.prepare(Preparation(raw, str(tmp_path / "bin"), "de", "en", SPLITS, 300, workers=1))


@pytest.mark.main_lane  # (the plugin's own code, whatever fairseq's version)
def test_a_killed_command_leaves_no_child_running(tmp_path):
    """annotated-prepare (or -evaluate) killed by SIGKILL while fairseq-preprocess (or
    -generate) runs: the child gets SIGTERM from the kernel (PR_SET_PDEATHSIG) and stops."""
    import signal
    import subprocess
    import sys
    import time

    pid_file = tmp_path / "child.pid"
    child = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    parent = ("import sys; from fairseq_plugin.cli.common import run; "
              f"run([sys.executable, '-c', {child!r}], {str(tmp_path / 'log')!r})")
    proc = subprocess.Popen([sys.executable, "-c", parent], cwd=REPO)
    deadline = time.monotonic() + 60
    while not (pid_file.exists() and pid_file.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    grandchild = int(pid_file.read_text())
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{grandchild}") and time.monotonic() < deadline:
        with open(f"/proc/{grandchild}/stat") as f:  # a zombie until init reaps it
            if f.read().split(") ")[1].startswith("Z"):
                break
        time.sleep(0.05)
    else:
        assert not os.path.exists(f"/proc/{grandchild}"), "the child still runs"


@pytest.mark.main_lane  # (the plugin's own code, whatever fairseq's version)
@pytest.mark.parametrize("signum, when", [
    (2, "tokenise train: "),  # Ctrl-C (the whole process group) as BPE is learnt: DEST untouched
    (15, "$ "),  # SIGTERM while fairseq-preprocess writes into DEST
])
def test_a_stopped_preparation_ends_in_one_line_and_its_rerun_says_what_to_do(signum, when,
                                                                               tmp_path):
    """Ctrl-C or SIGTERM while annotated-prepare works: one line saying so and what to do, the
    signal's exit status, no traceback from it or its workers, no child left; the rerun names
    the unfinished preparation, or, where DEST was untouched, prepares."""
    import signal
    import subprocess
    import sys
    import time

    raw = raw_corpus(tmp_path / "raw", 300, copies=200)
    dest = tmp_path / "bin"
    command = [sys.executable, "-m", "fairseq_plugin.cli.prepare", "--source-lang", "de",
               "--target-lang", "en", "--raw-dir", raw, "--dest", str(dest), "--workers", "2"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, cwd=REPO)
    for line in proc.stdout:
        if line.startswith(when):
            break
    time.sleep(0.5)
    os.killpg(proc.pid, signum) if signum == 2 else proc.send_signal(signum)
    out = line + proc.stdout.read()
    assert proc.wait(timeout=60) == -signum
    assert "Traceback" not in out
    name = "Ctrl-C (SIGINT)" if signum == 2 else signal.Signals(signum).name
    last = out.strip().splitlines()[-1]
    rerun = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    if signum == 2:
        assert last == f"annotated-prepare: stopped by {name}; nothing was written to {dest}"
        assert rerun.returncode == 0 and (dest / "prepare.json").exists()
        return
    assert last == (f"annotated-prepare: stopped by {name}; an unfinished preparation is left in "
                    f"{dest}: run the same command with --force to prepare it again")
    assert not running_with(str(dest))  # fairseq-preprocess stopped too
    assert rerun.returncode == 1 and "holds an unfinished preparation (it was interrupted)" in (
        rerun.stderr.strip().splitlines()[-1])



def _sigterm_takes_its_default_action():
    import signal

    return signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_a_pool_worker_ends_at_once_on_sigterm_whatever_handler_its_parent_has():
    """A command's SIGTERM handler (errors.stops_in_one_line) is Python's, and runs only between
    bytecodes: inherited by a pool worker, a SIGTERM from the pool's terminate() landing just
    before the worker blocks on the queue's lock was never handled, and annotated-prepare waited
    for that worker forever. The workers take the signal's default action instead."""
    import signal

    from fairseq_plugin.errors import stops_in_one_line

    @stops_in_one_line("test")
    def in_a_command():
        assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None)
        with streaming.pool(2) as workers:
            return [workers.apply_async(_sigterm_takes_its_default_action, ()).get()
                    for _ in range(4)]

    assert in_a_command() == [True] * 4
