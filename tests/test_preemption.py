"""A stopped or pre-empted fairseq-train loses nothing (fairseq_plugin/preemption.py).

A signal at a random moment (three seeds: SIGTERM, SIGUSR1, Ctrl-C's SIGINT) saves
checkpoint_last.pt after the update in flight and exits with 128 + the signal. After SIGTERM (the
three share one handler and one save) the same command resumes at that update with the
uninterrupted run's learning rates, and trains exactly as fairseq's own resume from that update
does (stopped by --max-update there, then resumed): the same losses, as close to the
uninterrupted run. (fairseq's own resume is exact at the next update within the first epoch;
from a later epoch it is not: 3.521 against 3.539 at update 29 here.) A torn checkpoint_last.pt
is passed over for the newest whole one; a copy killed midway leaves the old file whole.
"""

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import cli, tiny_training
from test_distributed import free_port, torchrun_node
from fairseq_plugin import PluginError, checkpoints, fairseq_changes, preemption

UPDATES = 40  # about 4 epochs of 10 updates: a stop falls within an epoch or at its end
ENV = {k: v for k, v in os.environ.items() if k != "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"}
ENV.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


DATA_BIN = {"train": 1000, "valid": 50}  # the reverse task's pairs (conftest: data_bin)


def command(data_bin, save_dir, *extra):
    return [os.path.join(os.path.dirname(sys.executable), "fairseq-train"),
            *tiny_training(data_bin, save_dir, "--dropout", "0", "--seed", "5", "--log-format",
                           "json", "--log-interval", "1", "--num-workers", "0",
                           "--disable-validation", *extra)]


def updates_logged(log: str):
    """{update: (loss, lr)} of fairseq's per-update json lines."""
    out = {}
    for line in log.splitlines():
        start = line.find("{")
        if "train_inner" in line and start >= 0:
            entry = json.loads(line[start:])
            out[int(entry["num_updates"])] = (float(entry["loss"]), float(entry["lr"]))
    return out


def run(data_bin, save_dir, *extra):
    proc = subprocess.run(command(data_bin, save_dir, *extra), capture_output=True, text=True,
                          env=ENV, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def last_model(save_dir):
    return torch.load(save_dir / "checkpoint_last.pt", weights_only=False)["model"]


def gap(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def signalled_at_random(data_bin, save_dir, log_path, signum, seed):
    """fairseq-train stopped by ``signum`` once a random update has been logged; returns the
    update it was sent after, its exit status and its output."""
    after = random.Random(seed).randint(3, UPDATES - 5)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command(data_bin, save_dir, "--max-update", str(UPDATES)),
                                stdout=log, stderr=subprocess.STDOUT, env=ENV)
    deadline = time.monotonic() + 300
    while max(updates_logged(log_path.read_text()), default=0) < after:
        assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
        time.sleep(0.01)
    proc.send_signal(signum)
    return after, proc.wait(timeout=300), log_path.read_text()


@pytest.fixture(scope="module")
def uninterrupted(data_bin, tmp_path_factory):
    save = tmp_path_factory.mktemp("whole")
    log = run(data_bin, save, "--max-update", str(UPDATES))
    return updates_logged(log), last_model(save)


def stopped_and_saved(data_bin, tmp_path, signum, seed):
    """fairseq-train stopped by ``signum`` at a random moment: it saved checkpoint_last.pt after
    the update in flight, said so in one line and exited with 128 + the signal; returns the save
    directory and that update."""
    save = tmp_path / "stopped"
    after, status, log = signalled_at_random(data_bin, save, tmp_path / "stopped.log", signum,
                                             seed)
    assert status == 128 + signum, log[-3000:]
    lines = [line for line in log.splitlines() if line.startswith("fairseq_plugin: ")]
    saved_at = max(updates_logged(log))
    assert lines == [f"fairseq_plugin: {signal.Signals(signum).name}: saved "
                     f"{save / 'checkpoint_last.pt'} at update {saved_at} (epoch "
                     f"{lines[0].split('(epoch ')[1]}"], log[-2000:]
    assert lines[0].endswith("; the same command resumes from there")
    assert after <= saved_at <= after + 2  # the update in flight, then the stop
    assert "Traceback" not in log
    state = torch.load(save / "checkpoint_last.pt", weights_only=False)
    assert state["optimizer_history"][-1]["num_updates"] == saved_at
    return save, saved_at


# (main lane only, for CI's time: the three signals share one handler and one save, whose resume
# the SIGTERM test below proves in both lanes)
@pytest.mark.main_lane
@pytest.mark.parametrize("signum, seed", [(signal.SIGUSR1, 1), (signal.SIGINT, 2)],
                         ids=["SIGUSR1", "SIGINT"])
def test_sigusr1_and_ctrl_c_at_a_random_moment_save_as_sigterm_does(data_bin, tmp_path, signum,
                                                                    seed):
    stopped_and_saved(data_bin, tmp_path, signum, seed)


def test_sigterm_at_a_random_moment_saves_and_the_same_command_resumes_there(
        data_bin, uninterrupted, tmp_path):
    whole_updates, whole_model = uninterrupted
    save, saved_at = stopped_and_saved(data_bin, tmp_path, signal.SIGTERM, 0)

    resumed_log = run(data_bin, save, "--max-update", str(UPDATES))
    resumed = updates_logged(resumed_log)
    assert f"@ {saved_at} updates)" in resumed_log  # fairseq's "Loaded checkpoint ..." line
    assert sorted(resumed) == list(range(saved_at + 1, UPDATES + 1)), "not resumed at the update"
    assert all(resumed[u][1] == pytest.approx(whole_updates[u][1], rel=1e-6) for u in resumed)

    # fairseq's own resume from the same update (stopped by --max-update there): the same
    # batches from the same state give the same losses, and the same gap to the uninterrupted run
    own = tmp_path / "fairseqs-own"
    run(data_bin, own, "--max-update", str(saved_at))
    own_resumed = updates_logged(run(data_bin, own, "--max-update", str(UPDATES)))
    assert all(resumed[u][0] == pytest.approx(own_resumed[u][0], abs=1e-3) for u in resumed), \
        (resumed, own_resumed)
    ours, fairseqs = gap(last_model(save), whole_model), gap(last_model(own), whole_model)
    print(f"stopped at update {saved_at}: max |parameter difference| from the uninterrupted run "
          f"{ours:.2e}; fairseq's own resume {fairseqs:.2e}")
    assert ours <= max(3 * fairseqs, 1e-5)


def test_a_torn_checkpoint_last_is_passed_over_for_the_newest_whole_one(data_bin, tmp_path):
    save = tmp_path / "run"
    run(data_bin, save, "--max-epoch", "2")
    last = save / "checkpoint_last.pt"
    data = last.read_bytes()
    last.write_bytes(data[: len(data) // 2])  # a copy killed halfway (fairseq 0.12's own copy)
    os.utime(save / "checkpoint1.pt", (time.time() + 5, time.time() + 5))  # the newest whole one
    log = run(data_bin, save, "--max-epoch", "3")
    assert (f"fairseq_plugin: {last} is damaged or incomplete; resuming from "
            f"{save / 'checkpoint1.pt'}, the newest whole checkpoint") in log
    assert "begin training epoch 2" in log and "begin training epoch 1\n" not in log


def test_a_torn_checkpoint_last_without_a_whole_one_is_refused_in_one_line(tmp_path):
    (tmp_path / "checkpoint_last.pt").write_bytes(b"PK\x03\x04 torn")
    cfg = type("Cfg", (), {"restore_file": "checkpoint_last.pt", "save_dir": str(tmp_path),
                           "finetune_from_model": None})()
    trainer = type("Trainer", (), {"checkpoint_suffix": "", "data_parallel_rank": 0})()
    with pytest.raises(PluginError, match="is damaged or incomplete and .* holds no whole "
                                          "checkpoint; move it away to start afresh"):
        preemption.resume_from_newest_whole(lambda *a, **k: None)(cfg, trainer)


def test_an_explicit_restore_file_that_does_not_exist_is_refused(data_bin, tmp_path):
    proc = cli("fairseq-train", *command(data_bin, tmp_path)[1:], "--restore-file",
               str(tmp_path / "missing.pt"), check=False)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        f"fairseq_plugin: error: --restore-file {tmp_path / 'missing.pt'} does not exist; give "
        f"an existing checkpoint, or leave the flag out to resume from "
        f"{tmp_path / 'checkpoint_last.pt'} if it is there")


def test_patience_counter_is_saved_and_restored(tmp_path, monkeypatch):
    from fairseq_cli import train

    monkeypatch.setattr(train.should_stop_early, "best", 1.5, raising=False)
    monkeypatch.setattr(train.should_stop_early, "num_runs", 2, raising=False)
    saved = {}
    preemption.save_patience_too(lambda self, f, extra: saved.update(extra))(None, "x.pt", {})
    assert saved[preemption.PATIENCE_KEY] == {"best": 1.5, "num_runs": 2}
    train.should_stop_early.best, train.should_stop_early.num_runs = None, 0  # a new process
    cfg = type("Cfg", (), {"restore_file": "checkpoint_last.pt", "save_dir": str(tmp_path),
                           "finetune_from_model": None})()
    trainer = type("Trainer", (), {"checkpoint_suffix": "", "data_parallel_rank": 0})()
    preemption.resume_from_newest_whole(lambda *a, **k: (saved, None))(cfg, trainer)
    assert (train.should_stop_early.best, train.should_stop_early.num_runs) == (1.5, 2)


def half_then_killed(src, dst, *args, **kwargs):
    with open(src, "rb") as f, open(dst, "wb") as out:
        out.write(f.read()[:100])
    raise KeyboardInterrupt  # the process killed midway


def test_a_copy_killed_midway_leaves_the_old_checkpoint_whole(tmp_path, monkeypatch):
    from fairseq import checkpoint_utils

    new, last = tmp_path / "checkpoint3.pt", tmp_path / "checkpoint_last.pt"
    torch.save({"step": 3, "w": torch.randn(100, 100)}, new)
    torch.save({"step": 2, "w": torch.randn(100, 100)}, last)
    monkeypatch.setattr("shutil.copyfile", half_then_killed)
    with pytest.raises(KeyboardInterrupt):
        checkpoint_utils.PathManager.copy(str(new), str(last), overwrite=True)
    assert checkpoints.is_whole(str(last)) and torch.load(last)["step"] == 2
    assert not os.path.exists(str(last) + ".tmp")
    # fairseq 0.12's own copy, the same way killed, tears it
    with fairseq_changes.removed("checkpoint_copies_whole"), pytest.raises(KeyboardInterrupt):
        checkpoint_utils.PathManager.copy(str(new), str(last), overwrite=True)
    assert not checkpoints.is_whole(str(last))


@pytest.mark.main_lane  # (what differs by fairseq version, the resume, is tested above)
def test_sigterm_to_torchrun_ranks_saves_once_at_one_update_and_they_resume(data_bin, tmp_path):
    """A scheduler's SIGTERM to both nodes' torchrun (which passes it to its rank): the ranks agree
    on one update, rank 0 saves there, both exit; torchrun again resumes from it."""
    save, port = tmp_path / "ddp", free_port()
    args = command(data_bin, save, "--max-update", str(UPDATES))
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    nodes = [torchrun_node(r, 2, 1, port, args, logs[r], env=ENV) for r in (0, 1)]
    deadline = time.monotonic() + 300
    while max(updates_logged(logs[0].read_text()), default=0) < 5:
        assert nodes[0].poll() is None and time.monotonic() < deadline, logs[0].read_text()[-3000:]
        time.sleep(0.01)
    for node in nodes:
        node.send_signal(signal.SIGTERM)
    for node in nodes:
        node.wait(timeout=120)
    out = logs[0].read_text()
    saved = [line for line in out.splitlines() if line.startswith("fairseq_plugin: SIGTERM")]
    assert len(saved) == 1, out[-3000:]
    at = int(saved[0].split(" at update ")[1].split()[0])
    assert at == max(updates_logged(out))
    assert torch.load(save / "checkpoint_last.pt", weights_only=False)[
        "optimizer_history"][-1]["num_updates"] == at

    port = free_port()
    nodes = [torchrun_node(r, 2, 1, port, args, logs[r], env=ENV) for r in (0, 1)]
    for node, log in zip(nodes, logs):
        assert node.wait(timeout=300) == 0, log.read_text()[-3000:]
    assert sorted(updates_logged(logs[0].read_text())) == list(range(at + 1, UPDATES + 1))


def test_processes_forked_after_the_handlers_stop_on_sigterm_as_by_default(tmp_path):
    """A pool's or data loader's workers forked from a training process inherit its handlers;
    they must still stop when terminated (else a pool waits for them forever)."""
    code = ("import multiprocessing, time\n"
            "from fairseq_plugin import preemption\n"
            "preemption.catch_stop_signals()\n"
            "worker = multiprocessing.get_context('fork').Process(target=time.sleep, args=(30,))\n"
            "worker.start(); time.sleep(0.5); worker.terminate(); worker.join(10)\n"
            "print(worker.exitcode)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert proc.stdout == f"{-signal.SIGTERM}\n", (proc.stdout, proc.stderr[-2000:])
