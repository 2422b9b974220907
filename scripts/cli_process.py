"""One of fairseq's CLI scripts run in a child process of scripts/benchmark.py, which says when the
script itself has finished: ``run(path)`` prints FINISHED once the script's main ends with exit
status 0, before Python's shutdown. Imports nothing else.

Why: on an H100 (torch 2.11, Python 3.12, 2026-11-26), fp16 fairseq-train stopped by --max-update
printed "done training", saved its checkpoint, and then sometimes aborted during the interpreter's
shutdown ("terminate called without an active exception", SIGABRT): 2 of our model's 4 runs
(fairseq's transformer: 2 runs; bf16: 6 runs, none aborted).
A Python daemon thread that is inside one of torch's operators when the interpreter exits ends
that way (a thread doing matrix products, 6 aborts in 6 runs here on the CPU); fairseq's
BufferedIterator prefetches batches in such a thread. The benchmark keeps the figures of a
command that finished before such an abort, and says so (benchmark.py: run_measured).
"""

import runpy

FINISHED = "cli_process: the command finished with exit status 0"


def run(path: str) -> None:
    """Run the script at ``path`` as __main__; print FINISHED if it ends with exit status 0 (an
    exception or another exit status goes on up, as from the script itself)."""
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as stop:
        if stop.code not in (None, 0):
            raise
    print(FINISHED, flush=True)
