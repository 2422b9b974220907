"""The child process that runs one of fairseq's commands: its set-up (``Device.command``: the
GPU's peak counter, bf16), its peak memory, and its end told apart from an abort at shutdown.
Imports only the standard library: the child loads this file by its path, not through the
package, whose ``fairseq_plugin`` would register before fairseq imports the given --user-dir.

The GPU's peak: fairseq's trainer calls torch.cuda.reset_peak_memory_stats() after every step
(to log gb_free), so torch.cuda.max_memory_allocated() alone holds only what came after the last
step. ``PeakCounter`` wraps that reset and keeps the highest reading.

The abort: fp16 fairseq-train on an H100 and an H200 sometimes died with SIGABRT in the
interpreter's shutdown after a complete checkpoint (docs/benchmarks.md, "Caveats"); ``run``
prints FINISHED once the script has ended with status 0, so its figures are kept, with a note.
"""

import atexit
import os
import runpy
import signal
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
FINISHED = "benchmark child: the command finished with exit status 0"
PRINTED = "cuda peak MB"  # the GPU's peak line at exit: then MiB, then when it came


def child_import(name: str) -> str:
    """Python code that imports benchmark/NAME.py by its path, as a module of its own."""
    path = os.path.join(HERE, f"{name}.py")
    return (f"spec = importlib.util.spec_from_file_location({name!r}, {path!r}); "
            f"{name} = importlib.util.module_from_spec(spec); spec.loader.exec_module({name}); ")


def run(path: str) -> None:
    """Run the script at ``path`` as __main__; print FINISHED if it ends with exit status 0 (an
    exception or another status goes on up)."""
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as stop:
        if stop.code not in (None, 0):
            raise
    print(FINISHED, flush=True)


class PeakCounter:
    """torch.cuda's peak counter, kept across others' resets of it (one per process: it wraps the
    module's reset). ``cuda``: torch.cuda, or a stand-in with its functions (tests)."""

    def __init__(self, cuda=None):
        if cuda is None:
            import torch
            cuda = torch.cuda
        self.cuda, self.reset = cuda, cuda.reset_peak_memory_stats
        self.highest = self.resets = self.highest_after = 0
        self.between = None  # bytes allocated at the last reset (between two training steps)
        cuda.reset_peak_memory_stats = self.reset_keeping_the_peak

    def reset_keeping_the_peak(self, *args, **kwargs):
        reading = self.cuda.max_memory_allocated()
        if reading > self.highest:
            self.highest, self.highest_after = reading, self.resets
        self.resets += 1
        self.between = self.cuda.memory_allocated()
        self.reset(*args, **kwargs)

    def start(self) -> int:
        """Count from now on; returns the bytes allocated now."""
        self.cuda.synchronize()
        self.reset()
        self.highest = self.resets = self.highest_after = 0
        self.between = None
        return self.cuda.memory_allocated()

    def peak(self) -> int:
        """The most bytes allocated at once since start()."""
        self.cuda.synchronize()
        return max(self.highest, self.cuda.max_memory_allocated())

    def peak_of(self, work) -> int:
        """The most bytes allocated at once while ``work()`` runs, beyond those before it."""
        before = self.start()
        work()
        return self.peak() - before

    def where(self) -> str:
        """When the peak came, counting the resets fairseq's trainer makes after each step, and
        what was allocated at the last one."""
        if self.resets == 0:
            return "(no training step)"
        when = ("after the last training step" if self.cuda.max_memory_allocated() > self.highest
                else f"in training step {self.highest_after + 1} of {self.resets}")
        return f"{when}; {self.between / 2 ** 20:.1f} MB allocated between steps"


def switch_on(cuda=None) -> PeakCounter:
    """Count from here to the process's exit, which prints PRINTED, the peak in MiB and when it
    came (CUDA and cuBLAS set up first, so that their own buffers count as before)."""
    if cuda is None:
        import torch
        x = torch.ones(64, 64, device="cuda", dtype=torch.half)
        x @ x
    counter = PeakCounter(cuda)
    counter.start()
    atexit.register(lambda: print(PRINTED, counter.peak() / 2 ** 20, counter.where(), flush=True))
    return counter


# the set-ups of a child, for every contestant alike
CUDA_PEAK = child_import("child") + "child.switch_on(); "
IN_BF16 = child_import("bf16") + "bf16.install(); "  # bf16.py: fairseq_changes.BENCHMARK_BF16


class Device:
    """Where fairseq runs: its flags, how its child is set up, how its peak memory is read (the
    process's resident memory on the CPU, PeakCounter on a GPU)."""

    def __init__(self, kind: str = "cpu", precision: str = "fp32"):
        self.kind, self.precision = kind, precision

    def flags(self):
        return (["--cpu"] if self.kind == "cpu" else []) + (
            [] if self.precision == "fp32" else [f"--{self.precision}"])

    def command(self, cmd):
        """fairseq's command ``cmd`` as run here: where a set-up is needed, in a Python that runs
        it first (-X faulthandler: an abort prints each thread's stack)."""
        setup = ((CUDA_PEAK if self.kind == "cuda" else "")
                 + (IN_BF16 if self.precision == "bf16" else ""))
        if not setup:
            return cmd
        return [sys.executable, "-X", "faulthandler", "-c", "import importlib.util, sys, torch; "
                f"sys.argv = sys.argv[1:]; {setup}" + child_import("child")
                + "child.run(sys.argv[0])", *cmd]

    def peak(self, out: str, rss_mb: float):
        """(peak MB, on a GPU when it came) of a command that printed ``out``."""
        if self.kind == "cpu":
            return rss_mb, ""
        mib, where = out.rsplit(PRINTED + " ", 1)[1].splitlines()[0].split(None, 1)
        return float(mib), where


ABORTED_AFTER_FINISHING = []  # the commands that did (names), for the summary


def run_measured(cmd, device=Device()):
    """Run a command on ``device``: (stdout + stderr, peak MB, on a GPU when the peak came). A
    command that printed FINISHED and then aborted keeps its figures, with a note."""
    name = os.path.basename(str(cmd[0]))
    proc = subprocess.Popen(device.command([str(c) for c in cmd]), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        out = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
    except BaseException:  # e.g. Stopped: the command does not outlive the benchmark
        proc.kill()
        proc.wait()
        raise
    code = os.waitstatus_to_exitcode(status)
    if code == -signal.SIGABRT and FINISHED in out:
        ABORTED_AFTER_FINISHING.append(name)
        print(f"  note: {name} finished (exit status 0), then aborted in Python's shutdown "
              "(SIGABRT); its figures are kept (fairseq_plugin/benchmark/child.py)", flush=True)
    elif code != 0:
        sys.stderr.write(out[-3000:])
        raise SystemExit(f"benchmark: error: {name} failed (its output's end is above)")
    return (out, *device.peak(out, usage.ru_maxrss / 1024.0))
