"""One training per save-dir (fairseq_plugin/run_dir.py): the saving process holds a POSIX lock on
the save-dir while it trains; a second training into it is refused in one line naming the holder,
before it loads anything; readers take no lock; a run killed with SIGKILL blocks nothing."""

import errno
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from fairseq import checkpoint_utils

from conftest import PLUGIN_DIR, BackgroundCli, assert_one_line_error, cli, tiny_training
from fairseq_plugin import PluginError, fairseq_changes, run_dir


DATA_BIN = {"train": 1000, "valid": 50, "test": 20}  # the reverse task's pairs (conftest: data_bin)


def train_args(data_bin, save_dir, *extra):
    return tiny_training(data_bin, save_dir, "--seed", "1", "--no-epoch-checkpoints",
                         "--log-format", "simple", *extra)


def wait_for(condition, what, timeout=120):
    start = time.time()
    while not condition():
        assert time.time() - start < timeout, f"no {what} after {timeout} s"
        time.sleep(0.2)


def posix_locks_on(path):
    """The holders (pids) of /proc/locks' POSIX locks on the file ``path``."""
    inode = os.stat(path).st_ino
    with open("/proc/locks") as f:
        return [int(fields[4]) for fields in (line.split() for line in f)
                if fields[1] == "POSIX" and int(fields[5].split(":")[-1]) == inode]


@pytest.mark.main_lane  # (the second lane: the lock against its fairseq, in-process, below)
def test_a_second_training_is_refused_readers_go_on_and_a_killed_run_blocks_nothing(
        data_bin, tmp_path):
    save_dir = tmp_path / "checkpoints"
    lock = save_dir / run_dir.LOCK_NAME
    first = BackgroundCli(tmp_path / "first.log", "fairseq-train",
                          *train_args(data_bin, save_dir, "--max-epoch", "200"))
    try:
        wait_for(lambda: (save_dir / "checkpoint_last.pt").exists(), "first checkpoint")
        assert f"pid {first.proc.pid} on host {socket.gethostname()}" in lock.read_text()
        assert posix_locks_on(lock) == [first.proc.pid]  # fcntl's lock, the one NFS carries
        second = cli("fairseq-train", *train_args(data_bin, save_dir, "--max-epoch", "1"),
                     check=False)
        assert second.returncode == 1
        assert_one_line_error(second, f"--save-dir {save_dir} is in use by another training (pid "
                              f"{first.proc.pid} on host {socket.gethostname()}",
                              "give this run another --save-dir")
        said = (second.stderr + second.stdout).lower()
        assert "loaded checkpoint" not in said and "model params" not in said  # before the model
        # readers take no lock: decoding the running training's checkpoint works
        cli("fairseq-generate", data_bin, "--user-dir", PLUGIN_DIR, "--path",
            save_dir / "checkpoint_last.pt", "--beam", "2", "--cpu", "--max-tokens", "1000")
        assert first.proc.poll() is None, "the first run stopped"
    finally:
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait()
    # the kernel dropped the killed run's lock: the same command resumes at once
    third = cli("fairseq-train", *train_args(data_bin, save_dir, "--max-epoch", "1",
                                             "--max-update", "2"), check=False)
    assert third.returncode == 0, third.stderr[-3000:]
    assert "loaded checkpoint" in (third.stderr + third.stdout).lower()


HOLD = ("import sys, fairseq_plugin; from fairseq import checkpoint_utils; "
        "checkpoint_utils.verify_checkpoint_directory(sys.argv[1]); print('held', flush=True); "
        "sys.stdin.read()")


def test_fairseq_lets_two_trainings_into_one_save_dir_only_without_the_change(tmp_path):
    """What fairseq-train does first in the saving process, verify_checkpoint_directory: with the
    change it refuses a save-dir another process holds; fairseq's own lets it through."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with fairseq_changes.removed("one_run_per_save_dir"):
            checkpoint_utils.verify_checkpoint_directory(str(tmp_path))  # fairseq: goes on
        with pytest.raises(PluginError, match=f"is in use by another training \\(pid "
                                              f"{holder.pid} on host"):
            checkpoint_utils.verify_checkpoint_directory(str(tmp_path))
    finally:
        holder.stdin.close()
        holder.wait()
    assert holder.returncode == 0


def test_a_file_system_without_locks_trains_unguarded_and_says_so(tmp_path, monkeypatch, capsys):
    def no_locks(*args):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(run_dir.fcntl, "lockf", no_locks)
    run_dir.lock_save_dir(str(tmp_path))
    assert capsys.readouterr().err == (
        f"fairseq_plugin: warning: the file system of --save-dir {tmp_path} has no locks "
        f"(ENOLCK): a second training into it would not be refused\n")
    assert os.path.realpath(tmp_path) not in run_dir._HELD
