"""Shared by the commands and demos: the plugin's location and running fairseq's CLIs."""

import os
import shlex
import subprocess
import sys

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def plugin_dir() -> str:
    """The directory to pass to --user-dir."""
    return PACKAGE_DIR


def fairseq_cli(name: str) -> str:
    """fairseq's console script next to this Python (the venv's), e.g. fairseq-train."""
    return os.path.join(os.path.dirname(sys.executable), name)


def run(cmd, log_path, echo_if=None):
    """Run a command, log all its output, echo the lines containing ``echo_if``."""
    cmd = [str(c) for c in cmd]
    print("$ " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    with open(log_path, "w") as log:
        # unbuffered: a child writing to a pipe would otherwise hold its lines back for minutes
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env)
        for line in proc.stdout:
            log.write(line)
            log.flush()
            if echo_if and echo_if in line:
                print("  " + line.split(" | ", 3)[-1].rstrip(), flush=True)
        if proc.wait() != 0:
            sys.exit(f"error: {os.path.basename(cmd[0])} failed (exit {proc.returncode}); "
                     f"see {log_path}")
