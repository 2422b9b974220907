"""One of fairseq's CLI scripts run in a child process of the benchmark, which says when the
script itself has finished: ``run(path)`` prints FINISHED once the script's main ends with exit
status 0, before Python's shutdown, and the Python threads still alive then (where each is).
Imports nothing else.

Why: on an H100 (torch 2.11, Python 3.12, 2026-11-26), fp16 fairseq-train stopped by --max-update
printed "done training", saved its checkpoint, and then sometimes aborted during the interpreter's
shutdown ("terminate called without an active exception", SIGABRT): 2 of our model's 4 runs
(fairseq's transformer: 2 runs; bf16: 6 runs, none aborted).
A Python daemon thread that is inside one of torch's operators when the interpreter exits ends
that way (a thread doing matrix products: 6 aborts in 6 runs on the CPU). On an H200
(2026-11-27) one of our model's and one of fairseq's transformer's 12 fp16 commands aborted so,
and faulthandler (on in the benchmark's children) showed only the main thread, with no Python
frame: the cause lies in native code at shutdown, not known yet. The benchmark keeps the figures
of a command that finished before such an abort, and says so, with the threads alive when the
script had finished (runs.py: run_measured).
"""

import os
import runpy
import sys
import threading

FINISHED = "cli_process: the command finished with exit status 0"
THREADS_ALIVE = "cli_process: threads alive at the end: "


def run(path: str) -> None:
    """Run the script at ``path`` as __main__; print FINISHED if it ends with exit status 0 (an
    exception or another exit status goes on up, as from the script itself), then the Python
    threads still alive, with where each is."""
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as stop:
        if stop.code not in (None, 0):
            raise
    print(FINISHED, flush=True)
    print(THREADS_ALIVE + (", ".join(other_threads()) or "none"),
          flush=True)


def other_threads():
    """The running threads but this one: "name (its class, daemon), at file:line in function"
    each."""
    frames = sys._current_frames()
    for thread in threading.enumerate():
        if thread is threading.current_thread():
            continue
        frame = frames.get(thread.ident)
        where = (f"at {os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} in "
                 f"{frame.f_code.co_name}" if frame is not None else "no Python frame")
        yield (f"{thread.name} ({type(thread).__name__}, "
               f"{'daemon' if thread.daemon else 'not daemon'}), {where}")
