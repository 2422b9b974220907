"""What `make test` claims holds unconditionally under CI: the fairseq 0.12.2 lane cannot be
skipped there for want of a python3.10."""

import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def lane_without_python310(**env):
    """make's lane as a user's shell runs it: not as a sub-make of `make test` (whose MAKELEVEL
    would make its error line `make[1]: ***`)."""
    outer = {key: value for key, value in os.environ.items()
             if key not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    return subprocess.run(["make", "--no-print-directory", "-s", "test-fairseq-0.12.2",
                           "PYTHON310="], cwd=ROOT, capture_output=True, text=True,
                          env={**outer, "CI": "", **env})


def test_under_ci_a_missing_python310_fails_the_lane_with_one_line():
    proc = lane_without_python310(CI="true")
    assert proc.returncode != 0
    ours = [line for line in proc.stderr.splitlines() if not line.startswith("make: ***")]
    assert ours == ["make test: CI=true but no python3.10 on PATH or in ~/.pyenv for the fairseq "
                    "0.12.2 lane; install one or give PYTHON310=..."]
    assert "SKIPPED" not in proc.stdout


def test_elsewhere_a_missing_python310_skips_the_lane_and_says_so():
    proc = lane_without_python310()
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ("SKIPPED the fairseq 0.12.2 lane: no python3.10 on PATH or in "
                                   "~/.pyenv (PYTHON310=...)")


def test_ci_runs_make_test_with_ci_set():
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        lines = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    assert "export CI=true" in lines and lines[-1] == "make test"
