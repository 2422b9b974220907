"""A stopped or pre-empted fairseq-train loses nothing (fairseq_changes.py installs these).

- SIGTERM, SIGUSR1 (a scheduler's notice of preemption) and SIGINT (Ctrl-C), once training has
  made its first update: after the update in flight, every rank agrees to stop at the same
  update, checkpoint_last.pt is saved there, one line says so, and the run exits with 128 + the
  signal's number. The same command resumes from
  that update: fairseq's checkpoint holds the LR schedule's state and the position within the
  epoch; the early-stopping counter (--patience) is saved beside them. A second signal stops at
  once, without saving. A signal at an epoch's last update saves without that epoch's validation.
- If checkpoint_last.pt is damaged anyway (a full disk, a copy from elsewhere), the rerun says so
  in one line and resumes from the newest whole checkpoint in --save-dir.
- An explicit --restore-file that does not exist is refused (fairseq would train from scratch);
  its default, checkpoint_last.pt, keeps its meaning: start afresh where there is none.
"""

import functools
import os
import signal
import sys
import threading

import torch

from .checkpoints import is_whole, newest_whole_checkpoint
from .errors import PluginError

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
PATIENCE_KEY = "fairseq_plugin_patience"  # in a checkpoint's extra_state
_received = []  # the stop signals received, in order


def _on_stop_signal(signum, frame):
    if os.getpid() != _catching[0]:  # a forked child (a data or pool worker): as by default
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    if _received:
        sys.stderr.write(f"fairseq_plugin: {signal.Signals(signum).name} again: stopping now, "
                         f"without saving\n")
        sys.stderr.flush()
        raise SystemExit(128 + signum)
    _received.append(signum)


_catching = [0]  # the process whose stop signals set the flag


def catch_stop_signals() -> None:
    """Stop signals only set a flag, in this process (from its main thread: where Python runs
    signal handlers). Called once training has made its first update: before, a signal stops
    the run as it would without the plugin, losing no more than that update."""
    if _catching[0] != os.getpid() and threading.current_thread() is threading.main_thread():
        _catching[0] = os.getpid()
        for signum in STOP_SIGNALS:
            signal.signal(signum, _on_stop_signal)


def agreed_stop_signal(trainer) -> int:
    """The signal every rank stops for (0: none), the same on all ranks: the largest number any
    rank received (one small all-reduce an update when there are several ranks)."""
    signum = max(_received, default=0)
    if trainer.data_parallel_world_size > 1:
        flag = torch.tensor([signum], device=trainer.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX,
                                     group=trainer.data_parallel_process_group)
        signum = int(flag.item())
    return signum


def save_when_signalled(validate_and_save):
    """fairseq-train's ``validate_and_save``, called after every update (fairseq_changes.py)."""
    from fairseq import checkpoint_utils

    @functools.wraps(validate_and_save)
    def wrapper(cfg, trainer, task, epoch_itr, valid_subsets, end_of_epoch):
        catch_stop_signals()
        signum = agreed_stop_signal(trainer)
        if not signum:
            return validate_and_save(cfg, trainer, task, epoch_itr, valid_subsets, end_of_epoch)
        checkpoint_utils.save_checkpoint(cfg.checkpoint, trainer, epoch_itr, None)
        if trainer.data_parallel_world_size > 1:  # no rank leaves before rank 0 has written
            torch.distributed.barrier(group=trainer.data_parallel_process_group)
        if trainer.data_parallel_rank == 0:
            name = signal.Signals(signum).name
            saved = ("nothing saved (--no-save)" if cfg.checkpoint.no_save else
                     f"saved {os.path.join(cfg.checkpoint.save_dir, 'checkpoint_last.pt')}")
            sys.stderr.write(f"fairseq_plugin: {name}: {saved} at update "
                             f"{trainer.get_num_updates()} (epoch {epoch_itr.epoch}); the same "
                             f"command resumes from there\n")
            sys.stderr.flush()
        raise SystemExit(128 + signum)

    return wrapper


def _early_stopping():
    """fairseq-train's ``should_stop_early``, whose attributes are the --patience counter."""
    train = sys.modules.get("fairseq_cli.train")
    return getattr(train, "should_stop_early", None)


def save_patience_too(save_checkpoint):
    """fairseq's ``Trainer.save_checkpoint`` (fairseq_changes.py): the --patience counter in the
    checkpoint's extra_state."""

    @functools.wraps(save_checkpoint)
    def wrapper(self, filename, extra_state):
        counter = _early_stopping()
        if counter is not None and hasattr(counter, "num_runs"):
            extra_state = {**extra_state, PATIENCE_KEY: {"best": counter.best,
                                                         "num_runs": counter.num_runs}}
        return save_checkpoint(self, filename, extra_state)

    return wrapper


def resume_from_newest_whole(load_checkpoint):
    """fairseq's ``checkpoint_utils.load_checkpoint`` (fairseq_changes.py)."""

    @functools.wraps(load_checkpoint)
    def wrapper(cfg, trainer, **passthrough):
        restore, suffix = cfg.restore_file, trainer.checkpoint_suffix
        if restore == "checkpoint_last.pt":
            last = os.path.join(cfg.save_dir, f"checkpoint_last{suffix}.pt")
            if os.path.exists(last) and not is_whole(last):
                fallback = newest_whole_checkpoint(cfg.save_dir, but=last)
                if fallback is None:
                    raise PluginError(f"{last} is damaged or incomplete and {cfg.save_dir} "
                                      f"holds no whole checkpoint; move it away to start afresh")
                if trainer.data_parallel_rank == 0:
                    sys.stderr.write(f"fairseq_plugin: {last} is damaged or incomplete; "
                                     f"resuming from {fallback}, the newest whole checkpoint\n")
                restore = fallback
        elif not cfg.finetune_from_model and not os.path.exists(
                restore.replace(".pt", suffix + ".pt")):
            raise PluginError(f"--restore-file {restore} does not exist; give an existing "
                              f"checkpoint, or leave the flag out to resume from "
                              f"{os.path.join(cfg.save_dir, 'checkpoint_last.pt')} if it is there")
        given = cfg.restore_file
        cfg.restore_file = restore
        try:
            extra_state, epoch_itr = load_checkpoint(cfg, trainer, **passthrough)
        finally:
            cfg.restore_file = given
        counter = _early_stopping()
        if counter is not None and extra_state is not None and PATIENCE_KEY in extra_state:
            counter.best = extra_state[PATIENCE_KEY]["best"]
            counter.num_runs = extra_state[PATIENCE_KEY]["num_runs"]
        return extra_state, epoch_itr

    return wrapper
