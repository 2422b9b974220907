"""Let torch >= 2.6 load fairseq checkpoints with ``weights_only=True``.

torch 2.6 made ``torch.load(weights_only=True)`` the default. fairseq 0.12 checkpoints of
argparse-defined models (this plugin's before its dataclass configs, fairseq's ``transformer``)
store the model's configuration as an ``argparse.Namespace``, which the restricted unpickler
refuses ("Unsupported global: argparse.Namespace"), so fairseq-generate, fairseq-interactive and
--restore-file fail on them.

Rather than switching ``weights_only`` off for every ``torch.load`` in the process (or asking for
TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1), we add the few plain-data classes a fairseq checkpoint holds
to torch's allowlist. Loading stays restricted: no other global can be unpickled.

A damaged checkpoint file (truncated copy, interrupted save) gets one clear line naming the
file, instead of a zip-reader traceback.
"""

import argparse
import errno
import functools
import os
import pickle
import zipfile

import torch
from fairseq import checkpoint_utils

from .errors import PluginError

# what fairseq's trainer writes besides tensors, dicts, lists and numbers
CHECKPOINT_SAFE_GLOBALS = [argparse.Namespace]


def allow_fairseq_checkpoints() -> None:
    """Allowlist the classes above for ``torch.load(weights_only=True)`` (setup.py: torch >= 2.6)."""
    torch.serialization.add_safe_globals(CHECKPOINT_SAFE_GLOBALS)


allow_fairseq_checkpoints()


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


def explain_unreadable_checkpoints(load):
    """Wrap fairseq's ``load_checkpoint_to_cpu`` so a damaged file gives one clear line."""
    if getattr(load, "explains_unreadable", False):
        return load

    @functools.wraps(load)
    def load_checkpoint_to_cpu(path, *args, **kwargs):
        try:
            return load(path, *args, **kwargs)
        except Exception as e:
            # torch writes zip files; a file that is not one is damaged (or not a checkpoint)
            not_a_zip = (isinstance(path, str) and os.path.isfile(path)
                         and not zipfile.is_zipfile(path))
            if _refused_by_weights_only(e) or not (_unreadable(e) or not_a_zip):
                raise
            first = ("not the zip archive torch writes" if not_a_zip
                     else (str(e).strip().splitlines() or [type(e).__name__])[0])
            raise PluginError(
                f"cannot read checkpoint {path} ({first}): the file is damaged or incomplete; "
                f"use another one (e.g. checkpoint_best.pt or an earlier checkpointN.pt)") from e

    load_checkpoint_to_cpu.explains_unreadable = True
    return load_checkpoint_to_cpu


checkpoint_utils.load_checkpoint_to_cpu = explain_unreadable_checkpoints(
    checkpoint_utils.load_checkpoint_to_cpu)
