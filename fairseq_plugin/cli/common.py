"""Shared by the commands and demos: the plugin's location and running fairseq's CLIs."""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from typing import Optional

from ..errors import PluginError

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def plugin_dir() -> str:
    """The directory to pass to --user-dir."""
    return PACKAGE_DIR


def fairseq_cli(name: str) -> str:
    """fairseq's console script, e.g. fairseq-train: the one next to this Python (a venv's), else
    the one on PATH (``pip install --target DIR`` puts them in DIR/bin, as on an offline GPU node)."""
    beside = os.path.join(os.path.dirname(sys.executable), name)
    found = beside if os.path.exists(beside) else shutil.which(name)
    if found is None:
        raise PluginError(f"{name} is neither next to {sys.executable} nor on PATH: install "
                          "fairseq into this Python, or put the folder of its scripts on PATH")
    return found


def prepared_settings(data_bin):
    """The settings annotated-prepare recorded in DATA_BIN/prepare.json (languages, BPE codes)."""
    path = os.path.join(data_bin, "prepare.json")
    if not os.path.isfile(path):
        raise PluginError(f"{data_bin} has no prepare.json: give a data-bin made by "
                          f"annotated-prepare (it records the languages, BPE codes and raw text)")
    with open(path) as f:
        return json.load(f)


def check_checkpoint(path) -> None:
    """Refuse a checkpoint path that names no file, before any work starts."""
    if not os.path.isfile(path):
        raise PluginError(f"no checkpoint {path}; give the path of a .pt file that fairseq-train "
                          f"wrote (e.g. CHECKPOINTS/checkpoint_best.pt)")


_PROGRESS = re.compile(r"epoch (\d+):\s+(\d+) / (\d+) .*?\bups=([\d.]+)")


def training_progress(line: str, epochs: Optional[int] = None) -> Optional[str]:
    """fairseq-train's per-interval line (--log-format simple) as a progress line with the speed
    and an estimate of the time left, or None for other lines."""
    m = _PROGRESS.search(line)
    if m is None or "train_inner" not in line:
        return None
    epoch, done, total, ups = int(m[1]), int(m[2]), int(m[3]), float(m[4])
    left = total - done + (max(epochs - epoch, 0) * total if epochs else 0)
    when = f"about {left / ups / 60:.1f} min left" if ups > 0 else "time left unknown"
    scope = "in all" if epochs else "in this epoch"
    return f"epoch {epoch}: update {done}/{total}, {ups:.2f} updates/s, {when} {scope}"


_BATCHES = re.compile(r":\s+(\d+) / (\d+) wps=(\d+)")


def generation_progress(line: str, seconds: float) -> Optional[str]:
    """fairseq-generate's per-batch line (--log-format simple --log-interval 1) as a progress
    line with the speed and the time left, estimated from the ``seconds`` spent so far."""
    m = _BATCHES.search(line)
    if m is None:
        return None
    done, total, wps = int(m[1]), int(m[2]), int(m[3])
    left = seconds / done * (total - done)
    return f"batch {done}/{total}, {wps} target tokens/s, about {left / 60:.1f} min left"


class Progress:
    """Progress of a long step in this process: an updating bar on a terminal (tqdm); in a log or
    a pipe, a line every ``every`` seconds with the rate and the time left, and one at the end.
    ``update(n)`` counts work done; use it as a context manager, or call ``close()``."""

    def __init__(self, desc: str, total: Optional[int] = None, unit: str = "lines",
                 every: float = 10.0, file=None):
        self.file = file or sys.stderr
        self.desc, self.total, self.unit, self.every = desc, total, unit, every
        self.done = 0
        self.started = self.shown = time.monotonic()
        self.bar = None
        if self.file.isatty():
            from tqdm import tqdm

            self.bar = tqdm(desc=desc, total=total, unit=" " + unit, mininterval=1.0,
                            file=self.file)

    def update(self, n: int = 1) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        elif time.monotonic() - self.shown >= self.every:
            self.shown = time.monotonic()
            seconds = self.shown - self.started
            rate = self.done / seconds if seconds > 0 else float("inf")
            line = f"{self.desc}: {self.done:,}"
            if self.total:
                line += f"/{self.total:,}"
            line += f" {self.unit}, {rate:,.0f} {self.unit}/s"
            if self.total and 0 < rate < float("inf"):
                line += f", about {max(self.total - self.done, 0) / rate:.0f} s left"
            print(line, file=self.file, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        else:
            print(f"{self.desc}: {self.done:,} {self.unit} in "
                  f"{time.monotonic() - self.started:.1f} s", file=self.file, flush=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def progress(items, desc: str, unit: str = "lines"):
    """Iterate over a sized collection, showing Progress."""
    with Progress(desc, len(items), unit) as shown:
        for item in items:
            yield item
            shown.update()


def fairseq_validation(line: str) -> Optional[str]:
    """fairseq-train's validation line without its time stamp and logger name, or None."""
    if "valid on 'valid' subset" not in line:
        return None
    return line.split(" | ", 3)[-1].rstrip()


def die_with_parent() -> None:
    """In a child before it runs its program: on Linux, SIGTERM when its parent dies, however
    (PR_SET_PDEATHSIG), so that a killed command leaves no fairseq-preprocess or
    fairseq-generate writing on. Elsewhere nothing."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


def run(cmd, log_path, show=None, epochs=None, echo=print, output_path=None, append=False):
    """Run a command and log all its output as it comes. Echoed as they come: a progress line per
    log interval of fairseq-train (``epochs``: for the estimate) or batch of fairseq-generate,
    and what ``show(line)`` returns for a line (None: nothing). ``output_path``: the child's
    stdout goes there instead (e.g. fairseq-generate's translations), its stderr to the log.
    A failed command raises PluginError naming the log (``append``: added to its end)."""
    cmd = [str(c) for c in cmd]
    echo("$ " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    started = time.monotonic()
    with open(log_path, "a" if append else "w") as log, \
            open(output_path or os.devnull, "w") as output:
        # unbuffered: a child writing to a pipe would otherwise hold its lines back for minutes
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        proc = subprocess.Popen(cmd, stdout=output if output_path else subprocess.PIPE,
                                stderr=subprocess.PIPE if output_path else subprocess.STDOUT,
                                text=True, env=env, preexec_fn=die_with_parent)
        try:
            for line in proc.stderr if output_path else proc.stdout:
                log.write(line)
                log.flush()
                shown = (training_progress(line, epochs)
                         or generation_progress(line, time.monotonic() - started)
                         or (show(line) if show else None))
                if shown is not None:
                    echo("  " + shown, flush=True)
        except BaseException:  # an interrupt, a signal: the child stops with us
            proc.terminate()
            proc.wait()
            raise
    if proc.wait() != 0:
        raise PluginError(f"{os.path.basename(cmd[0])} failed (exit {proc.returncode}); "
                          f"see {os.path.abspath(log_path)}")
