"""A disk that fills during a save (fairseq_plugin/checkpoints.py): the save fails whole (its files
removed, checkpoint_best.pt and checkpoint_last.pt as they were, no partial file), the run ends in
one line naming the file, the space and the newest whole checkpoint, and once space is freed the
same command resumes from that checkpoint. On a tmpfs of a size the test computes, where the
first save fits and the second does not."""

import contextlib
import errno
import os
import subprocess
from types import SimpleNamespace

import pytest
from fairseq import checkpoint_utils

from conftest import assert_one_line_error, cli, tiny_training
from fairseq_plugin import PluginError, checkpoints, fairseq_changes


DATA_BIN = {"train": 200, "valid": 20}  # the reverse task's pairs (conftest: data_bin)


def train(data_bin, save_dir, epochs):
    return cli("fairseq-train", *tiny_training(data_bin, save_dir, "--dropout", "0", "--seed", "1",
                                               "--max-epoch", epochs, "--no-epoch-checkpoints",
                                               "--log-format", "simple"), check=False)


@contextlib.contextmanager
def small_file_system(path, size):
    """A tmpfs of ``size`` bytes at ``path`` (root, or CAP_SYS_ADMIN), unmounted afterwards."""
    os.makedirs(path)
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                           capture_output=True, text=True)
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({mount.stderr.strip()}): the full-disk "
                    "test needs root or CAP_SYS_ADMIN")
    try:
        yield lambda new_size: subprocess.run(
            ["mount", "-o", f"remount,size={new_size}", str(path)], check=True)
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.mark.main_lane  # (the second lane: both changes against its fairseq, below)
def test_a_full_disk_during_a_save_fails_it_whole_and_the_rerun_resumes(data_bin, tmp_path):
    # a checkpoint of this run: each save writes checkpoint_best.pt and copies it to
    # checkpoint_last.pt, so two fit in 2.5 checkpoints' space, and a second save (a third file
    # while it is written) does not
    assert train(data_bin, tmp_path / "measure", 1).returncode == 0
    size = os.path.getsize(tmp_path / "measure" / "checkpoint_last.pt")
    disk = tmp_path / "disk"
    with small_file_system(disk, (5 * size // 2) // 4096 * 4096 + 4096) as resize:
        save_dir = disk / "checkpoints"
        proc = train(data_bin, save_dir, 2)
        last = str(save_dir / "checkpoint_last.pt")
        update = checkpoints.update_of(last)
        line = assert_one_line_error(
            proc, f"could not write {save_dir}/checkpoint_", f": the disk holding {save_dir} is "
            f"full (a checkpoint takes {size / 1e6:,.1f} MB, ", "MB are free); nothing of this "
            f"save is kept, the newest whole checkpoint is {last} (update {update}): free space, "
            "then run the same command to resume from it")
        assert proc.returncode == 1, line
        assert sorted(os.listdir(save_dir)) == [".fairseq-train.lock", "checkpoint_best.pt",
                                                "checkpoint_last.pt"]  # nothing partial
        assert all(checkpoints.is_whole(save_dir / n) for n in ("checkpoint_best.pt",
                                                                "checkpoint_last.pt"))
        assert update and checkpoints.update_of(str(save_dir / "checkpoint_best.pt")) == update
        resize(8 * size)  # space freed: the same command resumes from the named checkpoint
        rerun = train(data_bin, save_dir, 2)
        assert rerun.returncode == 0, rerun.stderr[-3000:]
        assert f"@ {update} updates" in rerun.stdout + rerun.stderr
        assert checkpoints.update_of(last) > update


def fake_save(folder, replaced_first):
    """A save as fairseq's writes: a new checkpoint3.pt, then checkpoint_best.pt replaced
    whole, then the disk full while checkpoint_last.pt.tmp is written (``replaced_first``: the
    best checkpoint already replaced by then)."""
    def save_checkpoint(cfg, trainer, epoch_itr, val_loss):
        (folder / "checkpoint3.pt").write_text("new")
        if replaced_first:
            (folder / "best.new").write_text("new best")
            os.replace(folder / "best.new", folder / "checkpoint_best.pt")
        (folder / "checkpoint_last.pt.tmp").write_text("half")
        raise OSError(errno.ENOSPC, "No space left on device")
    return save_checkpoint


def test_a_save_that_fails_on_a_full_disk_puts_back_what_it_replaced(tmp_path):
    """Without the change fairseq leaves the new files, the half-written .tmp and an already
    replaced checkpoint_best.pt; with it the folder is as before the save, and one line."""
    cfg = SimpleNamespace(save_dir=str(tmp_path), no_save=False)
    trainer = SimpleNamespace(should_save_checkpoint_on_current_rank=True)
    for name in ("checkpoint_best.pt", "checkpoint_last.pt"):
        (tmp_path / name).write_text(f"old {name}")
    with pytest.raises(OSError):
        fake_save(tmp_path, True)(cfg, trainer, None, None)  # fairseq's own, as it is
    assert (tmp_path / "checkpoint_best.pt").read_text() == "new best"
    assert sorted(os.listdir(tmp_path))[:2] == ["checkpoint3.pt", "checkpoint_best.pt"]
    for name in ("checkpoint3.pt", "checkpoint_last.pt.tmp"):
        os.remove(tmp_path / name)
    (tmp_path / "checkpoint_best.pt").write_text("old checkpoint_best.pt")
    with pytest.raises(PluginError, match=f"could not write a checkpoint in {tmp_path}: the disk "
                                          f"holding {tmp_path} is full"):
        checkpoints.saves_fail_whole(fake_save(tmp_path, True))(cfg, trainer, None, None)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint_best.pt", "checkpoint_last.pt"]
    assert [(tmp_path / n).read_text() for n in sorted(os.listdir(tmp_path))] == [
        "old checkpoint_best.pt", "old checkpoint_last.pt"]


def test_fairseq_tries_a_full_disk_three_times_only_without_the_change(tmp_path, monkeypatch):
    tries = []

    def full(obj, f):
        tries.append(f)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint_utils.torch, "save", full)
    monkeypatch.setattr(checkpoint_utils.time, "sleep", lambda seconds: None)
    with open(tmp_path / "c.pt.tmp", "wb") as f:
        with fairseq_changes.removed("one_try_on_a_full_disk"), pytest.raises(OSError):
            checkpoint_utils._torch_persistent_save({}, f)
        assert len(tries) == 3
        with pytest.raises(OSError):
            checkpoint_utils._torch_persistent_save({}, f)
    assert len(tries) == 4
