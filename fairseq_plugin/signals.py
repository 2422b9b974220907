"""Ctrl-C and SIGTERM: a command ends with one line and the signal's exit status (128 + N for the
shell, killed-by-N for a parent), not a traceback.

SIGTERM raises :class:`Stopped` where the program is, as Ctrl-C raises KeyboardInterrupt; what a
command then prints is errors.py's (``command``, ``stops_in_one_line``, and sys.excepthook in
fairseq's commands); training's save on a signal is preemption.py's; children stop with their
parent (cli/common.py: run).
"""

import os
import signal
import sys


STOP_NAMES = {signal.SIGINT: "Ctrl-C (SIGINT)", signal.SIGTERM: "SIGTERM"}


class Stopped(BaseException):
    """SIGTERM, raised where the program is, as Ctrl-C raises KeyboardInterrupt."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def raise_stopped_in(pid: int):
    """A SIGTERM handler for the process ``pid``; a forked child that inherited it just ends by
    the signal, as without it (a pool's workers drop it at start: pool_worker_signals)."""
    def handler(signum, frame):
        if os.getpid() != pid:
            end_by_signal(None, signum)
        raise Stopped(signum)
    return handler


def end_by_signal(line, signum: int):
    """Print ``line`` (if any), then end this process by ``signum``: its default action back,
    the signal sent to itself (the exit status a parent and the shell expect)."""
    if line:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    sys.exit(128 + signum)  # (not reached: the signal's default action ends the process)


def pool_worker_signals() -> None:
    """A pool worker's initializer: Ctrl-C reaches the whole process group; the parent stops
    the workers (without this, each prints a KeyboardInterrupt traceback). SIGTERM, which the
    parent's pool sends its workers as it stops them, gets its default action back: the Python
    handler inherited from the parent runs only between bytecodes, so a SIGTERM that lands just
    before a worker blocks on the pool's queue lock would never run it, and the parent would
    wait for that worker forever (seen: annotated-prepare hung at the end of its pool)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def running_a_fairseq_command() -> bool:
    return os.path.basename(sys.argv[0] if sys.argv else "").startswith("fairseq-")


def stop_signals_in_one_line():
    """(fairseq_changes.py) In one of fairseq's commands, SIGTERM raises Stopped where the
    command is, as Ctrl-C raises KeyboardInterrupt, and errors.print_plugin_errors_as_one_line
    ends it with one line (training's own save on a signal, preemption.py, takes over at its
    first update). Returns what undoes it."""
    import threading

    if (not running_a_fairseq_command() or threading.current_thread() is not
            threading.main_thread() or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL):
        return lambda: None
    handler = raise_stopped_in(os.getpid())
    signal.signal(signal.SIGTERM, handler)

    def undo():
        if signal.getsignal(signal.SIGTERM) is handler:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
    return undo
