"""One training run per save-dir.

fairseq 0.12 has no lock on a run directory: a second fairseq-train into the same --save-dir (a
double launch, a requeued job whose predecessor has not exited, two shells) trains to the end, and
the two runs' saves overwrite each other's checkpoints without a word. Here the process that
writes the checkpoints (the one that checks the save-dir: global rank 0) holds an operating-system
lock on SAVE_DIR/.fairseq-train.lock for as long as it lives, taken before anything is loaded; a
second training into that save-dir is refused in one line that names the process holding it.

The lock is a POSIX record lock (``fcntl.lockf``, fcntl's F_SETLK), which NFS carries between
hosts (NFSv3 through its lock manager, NFSv4 in the protocol), as do Lustre (mounted with
``flock``), GPFS and BeeGFS; ``flock()`` is local to one host on some of them. The kernel (or the
NFS server, once the client is gone) drops it when the process ends, however it ends: a run killed
with SIGKILL never blocks its restart. On a file system without locks (lockf answers ENOLCK or
EOPNOTSUPP) the run goes on unguarded and says so in one warning line.
"""

import errno
import fcntl
import os
import socket
import sys
import time

from .errors import PluginError

LOCK_NAME = ".fairseq-train.lock"
_HELD = {}  # real save-dir path -> the open lock file (closing it would drop the lock)
NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


def holder(lock_path: str) -> str:
    """Who holds the lock, as the holder wrote it: "pid P on host H since T"."""
    try:
        with open(lock_path, encoding="utf-8") as f:
            return f.read().strip() or "a process that has not yet written its name"
    except OSError:
        return "another process"


def lock_save_dir(save_dir: str) -> None:
    """Hold the save-dir's lock until this process ends, or refuse in one line."""
    real = os.path.realpath(save_dir)
    if real in _HELD:  # this process trains into it again (in-process callers)
        return
    path = os.path.join(save_dir, LOCK_NAME)
    f = open(path, "a+", encoding="utf-8")
    try:
        fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        f.close()
        if e.errno in (errno.EACCES, errno.EAGAIN):
            raise PluginError(
                f"--save-dir {save_dir} is in use by another training ({holder(path)}): two runs "
                f"into one save-dir overwrite each other's checkpoints; wait for it to end or stop "
                f"it, or give this run another --save-dir") from None
        if e.errno in NO_LOCKS:
            sys.stderr.write(f"fairseq_plugin: warning: the file system of --save-dir {save_dir} "
                             f"has no locks ({errno.errorcode[e.errno]}): a second training into "
                             f"it would not be refused\n")
            return
        raise
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on host {socket.gethostname()} since "
            f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    f.flush()
    _HELD[real] = f


def locked_save_dir(verify_checkpoint_directory):
    """fairseq's ``checkpoint_utils.verify_checkpoint_directory`` (fairseq_changes.py), which
    fairseq-train calls in the process that saves, before it builds or loads anything."""
    def verify_and_lock(save_dir: str) -> None:
        verify_checkpoint_directory(save_dir)
        lock_save_dir(save_dir)
    return verify_and_lock
