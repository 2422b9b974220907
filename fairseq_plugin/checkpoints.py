"""Let torch >= 2.6 load fairseq checkpoints with ``weights_only=True``.

torch 2.6 made ``torch.load(weights_only=True)`` the default. fairseq 0.12 checkpoints of
argparse-defined models (this plugin's before its dataclass configs, fairseq's ``transformer``)
store the model's configuration as an ``argparse.Namespace``, which the restricted unpickler
refuses ("Unsupported global: argparse.Namespace"), so fairseq-generate, fairseq-interactive and
--restore-file fail on them.

Rather than switching ``weights_only`` off for every ``torch.load`` in the process (or asking for
TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1), we add the few plain-data classes a fairseq checkpoint holds
to torch's allowlist: the Namespace, and, while fairseq loads a checkpoint, numpy arrays of
numbers (the BLEU counts that fairseq-train --eval-bleu keeps in its saved metrics). Loading
stays restricted: no other global can be unpickled. torch < 2.4
has no allowlist and needs none: its ``torch.load`` default (``weights_only=False`` until 2.6)
reads a Namespace, as fairseq 0.12.2 expects.

A damaged checkpoint file (truncated copy, interrupted save) gets one clear line naming the
file, instead of a zip-reader traceback. A save that runs out of disk space fails whole: what it
wrote is removed, what it replaced is put back, and the run ends in one line naming the newest
whole checkpoint.
"""

import argparse
import contextlib
import errno
import functools
import glob
import os
import pickle
import shutil
import traceback
import zipfile

import numpy as np
import torch

from .errors import PluginError
from .torch_release import TORCH_RELEASE

# torch >= 2.4 (the allowlist came in 2.4, the weights_only default in 2.6)
HAS_ALLOWLIST = hasattr(torch.serialization, "add_safe_globals")
# torch >= 2.5: an allowlist for the duration of a ``with`` block
HAS_SCOPED_ALLOWLIST = hasattr(torch.serialization, "safe_globals")


def numeric_numpy_array_globals() -> list:
    """What unpickling a numpy array of numbers takes: numpy's array rebuilder (also under
    numpy 1's name, for checkpoints written there), ``ndarray``, ``dtype`` and the dtype class of
    each numeric type. fairseq-train --eval-bleu keeps its BLEU n-gram counts as int64 arrays in
    the metrics it saves with every checkpoint. numpy's pickle of an array of Python objects
    names the object dtype's class, which is not among these; a hand-made file can still build
    such an array, but its elements pass the same restricted unpickler."""
    numeric = [np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
               np.uint64, np.float16, np.float32, np.float64]
    rebuild = np.ndarray(0).__reduce__()[0]  # numpy._core.multiarray._reconstruct
    entries = [rebuild, np.ndarray, np.dtype] + [type(np.dtype(t)) for t in numeric]
    numpy_1_name = "numpy.core.multiarray._reconstruct"
    if f"{rebuild.__module__}.{rebuild.__name__}" != numpy_1_name and TORCH_RELEASE >= (2, 6):
        entries.append((rebuild, numpy_1_name))  # torch >= 2.6 takes (global, name)
    return entries


# what fairseq's trainer writes besides tensors, dicts, lists and numbers: the Namespace for
# every torch.load of the process (CTranslate2's converter loads old checkpoints itself); numpy
# arrays only while fairseq or this plugin loads a checkpoint (numeric_arrays_allowed)
CHECKPOINT_SAFE_GLOBALS = [argparse.Namespace]
NUMERIC_ARRAY_GLOBALS = numeric_numpy_array_globals() if HAS_ALLOWLIST else []


def allow_fairseq_checkpoint_globals():
    """Allowlist the Namespace for ``torch.load(weights_only=True)`` (torch 2.4, which has no
    scoped allowlist: the numpy arrays too); return what undoes it (fairseq_changes.py)."""
    if not HAS_ALLOWLIST:
        return lambda: None
    before = list(torch.serialization.get_safe_globals())
    torch.serialization.add_safe_globals(
        CHECKPOINT_SAFE_GLOBALS + ([] if HAS_SCOPED_ALLOWLIST else NUMERIC_ARRAY_GLOBALS))

    def undo():
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)
    return undo


def numeric_arrays_allowed():
    """A ``with`` block in which torch's weights_only loader also rebuilds numpy arrays of
    numbers: fairseq's checkpoint loading runs in one (and ``load_plain``)."""
    if HAS_SCOPED_ALLOWLIST:
        return torch.serialization.safe_globals(NUMERIC_ARRAY_GLOBALS)
    return contextlib.nullcontext()


def omegaconf_globals() -> list:
    """What unpickling a DictConfig made from a plain dict takes (fairseq's loaded checkpoint
    state holds its configuration as one)."""
    import collections
    import typing

    from omegaconf import DictConfig, ListConfig, base, nodes

    return [DictConfig, ListConfig, base.ContainerMetadata, base.Metadata, nodes.AnyNode,
            typing.Any, dict, list, int, collections.defaultdict]


def broadcast_reads_fairseq_state(broadcast_object_slow):
    """fairseq.distributed.utils._broadcast_object_slow (fairseq_changes.py): rank 0 sends the
    checkpoint state it loaded to the other ranks as torch.save's bytes, which they unpickle
    with torch's default loader, restricted from torch 2.6 on; they may take its DictConfig and
    numpy arrays (nothing else beyond tensors and plain data)."""
    if not HAS_SCOPED_ALLOWLIST:
        return broadcast_object_slow

    from fairseq.distributed import utils as distributed_utils

    @functools.wraps(broadcast_object_slow)
    def wrapper(*args, **kwargs):
        # (fairseq sends the tensors apart, each in the state as a _TensorPlaceholder; the
        # Namespace is allowed for the whole process already, and leaving the block would
        # remove it again)
        allowed = (omegaconf_globals() + NUMERIC_ARRAY_GLOBALS
                   + [distributed_utils._TensorPlaceholder])
        with torch.serialization.safe_globals(allowed):
            return broadcast_object_slow(*args, **kwargs)

    return wrapper


def load_plain(path: str) -> dict:
    """A checkpoint's raw contents, unpickled as restrictively as this torch allows: with
    ``weights_only`` where the allowlist exists, else with torch's (and fairseq's) default."""
    with numeric_arrays_allowed():
        return torch.load(path, map_location="cpu", weights_only=HAS_ALLOWLIST)


_WRITING = [None]  # the checkpoint file being written now (its name for a full disk's line)


def write_whole(path: str, write) -> None:
    """``write(tmp)`` writes the file, then it is renamed to ``path``: whole or not at all (its
    folder made if need be); a failed write leaves no PATH.tmp behind."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    _WRITING[0] = path
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def save_whole(state: dict, path: str) -> None:
    """torch.save ``state`` to ``path`` whole or not at all."""
    write_whole(path, functools.partial(torch.save, state))



def is_whole(path: str) -> bool:
    """Whether a checkpoint file is complete and undamaged. torch writes a zip archive that keeps
    a CRC-32 of every record (the pickle and each tensor's bytes); a truncated file has no
    readable directory and a changed byte fails its record's CRC. Reads the whole file once."""
    try:
        with zipfile.ZipFile(path) as archive:
            return archive.testzip() is None
    except (zipfile.BadZipFile, OSError, EOFError, ValueError):
        return False


class _WholeCopies:
    """fairseq's PathManager, except that ``copy`` of a local file writes DEST.tmp and renames it
    over DEST: the copy is whole or not there at all (fairseq_changes.py)."""

    def __init__(self, path_manager):
        self._path_manager = path_manager

    def __getattr__(self, name):  # everything else as fairseq's
        return getattr(self._path_manager, name)

    def copy(self, src_path: str, dst_path: str, overwrite: bool = False, **kwargs) -> bool:
        if "://" in src_path or "://" in dst_path:  # a remote store: fairseq's own
            return self._path_manager.copy(src_path, dst_path, overwrite, **kwargs)
        if os.path.exists(dst_path) and not overwrite:
            return False
        write_whole(dst_path, functools.partial(shutil.copyfile, src_path))
        return True


def whole_copies(path_manager):
    """checkpoint_utils.PathManager (fairseq_changes.py)."""
    return _WholeCopies(path_manager)


def _refused_by_weights_only(exc: BaseException) -> bool:
    """torch's restricted unpickler refused a class: the file is fine, the class is not allowed
    (garbage bytes fail in the same unpickler, with "Unsupported operand" instead)."""
    return isinstance(exc, pickle.UnpicklingError) and "Unsupported global" in str(exc)


def _unreadable(exc: BaseException) -> bool:
    """A damaged or truncated file, as opposed to any other failure while loading."""
    if isinstance(exc, (EOFError, zipfile.BadZipFile)):
        return True
    if isinstance(exc, OSError):  # torch's zip reader on a truncated file: EINVAL
        return exc.errno == errno.EINVAL
    if isinstance(exc, pickle.UnpicklingError):
        return not _refused_by_weights_only(exc)
    message = str(exc)
    return isinstance(exc, RuntimeError) and any(
        s in message for s in ("PytorchStreamReader", "magic number", "zip archive"))


def _raised_by_torch_load(exc: BaseException) -> bool:
    """Whether torch's reader itself failed (rather than fairseq, after reading the file)."""
    return any(frame.f_code.co_filename == torch.serialization.__file__
               for frame, _ in traceback.walk_tb(exc.__traceback__))


def newest_whole_checkpoint(folder: str, but: str = ""):
    """The most recently written whole checkpoint*.pt in ``folder`` other than ``but``."""
    paths = [p for p in glob.glob(os.path.join(folder, "checkpoint*.pt"))
             if not (but and os.path.exists(but) and os.path.samefile(p, but))]
    for path in sorted(paths, key=os.path.getmtime, reverse=True):
        if is_whole(path):
            return path
    return None


def instead(path: str) -> str:
    """What to use instead of a damaged checkpoint: the newest whole one beside it, if any."""
    newest = newest_whole_checkpoint(os.path.dirname(os.path.abspath(path)), but=path)
    if newest:
        return f"use another one: the newest whole checkpoint beside it is {newest}"
    return "use another one (e.g. checkpoint_best.pt or an earlier checkpointN.pt)"


def explain_unreadable_checkpoints(load):
    """fairseq's ``checkpoint_utils.load_checkpoint_to_cpu`` (fairseq_changes.py): a damaged file
    gives one clear line."""
    @functools.wraps(load)
    def load_checkpoint_to_cpu(path, *args, **kwargs):
        local_zip = isinstance(path, str) and os.path.isfile(path) and zipfile.is_zipfile(path)
        if local_zip and not is_whole(path):  # torch would read changed tensor bytes silently
            raise PluginError(f"cannot read checkpoint {path} (a record fails its CRC-32 "
                              f"check): the file is damaged or incomplete; {instead(path)}")
        try:
            with numeric_arrays_allowed():
                return load(path, *args, **kwargs)
        except Exception as e:
            # torch writes zip files; a file that is not one is damaged (or not a checkpoint)
            not_a_zip = (isinstance(path, str) and os.path.isfile(path)
                         and not zipfile.is_zipfile(path))
            damaged = _unreadable(e) or (not_a_zip and _raised_by_torch_load(e))
            if _refused_by_weights_only(e) or not damaged:
                raise
            first = ("not the zip archive torch writes" if not_a_zip
                     else (str(e).strip().splitlines() or [type(e).__name__])[0])
            raise PluginError(f"cannot read checkpoint {path} ({first}): the file is damaged or "
                              f"incomplete; {instead(path)}") from e

    return load_checkpoint_to_cpu



# -- A full disk during a save. fairseq 0.12 retries torch.save three times into the same half-written
# file, logs each traceback, leaves CHECKPOINT.pt.tmp behind, and may have replaced
# checkpoint_best.pt already when the copy to checkpoint_last.pt fails.

REPLACED = ("checkpoint_best", "checkpoint_last")  # the names a save writes over
KEPT = ".before-save"  # a hard link to each of those while a save runs


def out_of_space(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it was raised from) says the disk or the quota is full; torch's
    zip writer says "file write failed" where Python's write said ENOSPC."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if isinstance(exc, RuntimeError) and ("file write failed" in str(exc)
                                              or "No space left" in str(exc)):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def one_try_on_a_full_disk(torch_persistent_save):
    """fairseq's ``checkpoint_utils._torch_persistent_save`` (fairseq_changes.py): a full disk
    ends the save at once, not after three tries (into the same half-written file) and a logged
    traceback each."""
    @functools.wraps(torch_persistent_save)
    def save(obj, f):
        if isinstance(f, str):
            return torch_persistent_save(obj, f)
        _WRITING[0] = getattr(f, "name", None)
        try:
            return torch.save(obj, f)
        except Exception as exc:
            if out_of_space(exc):
                raise
            return torch_persistent_save(obj, f)  # fairseq's own tries
    return save


def update_of(path: str):
    """The number of updates a checkpoint was saved at, or None where it does not say."""
    try:
        return load_plain(path)["optimizer_history"][-1]["num_updates"]
    except Exception:  # (an unreadable file has no update to name)
        return None


def full_disk_error(save_dir: str, failed: str) -> PluginError:
    """One line: the file that could not be written, the space it needed and the disk had, and
    the newest whole checkpoint the same command resumes from."""
    newest = newest_whole_checkpoint(save_dir)
    size = os.path.getsize(newest) if newest else None
    free = shutil.disk_usage(save_dir).free
    needed = f"a checkpoint takes {size / 1e6:,.1f} MB, " if size else ""
    if newest:
        update = update_of(newest)
        kept = (f"the newest whole checkpoint is {newest}"
                + (f" (update {update})" if update is not None else "")
                + ": free space, then run the same command to resume from it")
    else:
        kept = "there is no whole checkpoint yet: free space, then run the same command"
    return PluginError(f"could not write {failed}: the disk holding {save_dir} is full "
                       f"({needed}{free / 1e6:,.1f} MB are free); nothing of this save is kept, "
                       f"{kept}")


def saves_fail_whole(save_checkpoint):
    """fairseq's ``checkpoint_utils.save_checkpoint`` (fairseq_changes.py): a save that runs out
    of disk space is undone (its new files removed, checkpoint_best.pt and checkpoint_last.pt as
    they were) and ends the run in one line (full_disk_error)."""
    @functools.wraps(save_checkpoint)
    def save(cfg, trainer, epoch_itr, val_loss):
        folder = cfg.save_dir
        if (cfg.no_save or not trainer.should_save_checkpoint_on_current_rank
                or not os.path.isdir(folder)):
            return save_checkpoint(cfg, trainer, epoch_itr, val_loss)
        _WRITING[0] = None
        before = set(os.listdir(folder))
        kept = {}
        for name in before:  # (links take no space but a directory entry)
            if name.startswith(REPLACED) and name.endswith(".pt"):
                with contextlib.suppress(OSError):
                    os.link(os.path.join(folder, name), os.path.join(folder, name + KEPT))
                    kept[name] = name + KEPT
        try:
            return save_checkpoint(cfg, trainer, epoch_itr, val_loss)
        except BaseException as exc:
            if not out_of_space(exc):
                raise
            made = sorted(set(os.listdir(folder)) - before - set(kept.values()))
            for name in made:
                os.remove(os.path.join(folder, name))
            for name, link in kept.items():  # (rename does nothing where both are one file)
                target, saved = os.path.join(folder, name), os.path.join(folder, link)
                if os.path.exists(target) and os.path.samefile(target, saved):
                    os.remove(saved)
                else:
                    os.replace(saved, target)
            kept = {}
            failed = _WRITING[0] or f"a checkpoint in {folder}"
            raise full_disk_error(folder, failed[:-len(".tmp")] if failed.endswith(".tmp")
                                  else failed) from None
        finally:
            for link in kept.values():
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(folder, link))
    return save
