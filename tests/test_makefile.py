"""What `make test` claims holds unconditionally under CI: the fairseq 0.12.2 lane cannot be
skipped there for want of a python3.10; and how its two workers share the files."""

import os
import subprocess
from types import SimpleNamespace

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


def test_the_two_workers_get_each_file_whole_and_the_files_sharing_a_model_together():
    """make test's pytest-xdist workers take scopes (tests/conftest.py's scheduler): one per
    file, and one for the files that use each shared trained model, trained once."""
    import conftest

    two_workers = SimpleNamespace(getvalue={"tx": ["2*popen"]}.get)  # -n 2's config, as read
    scope = conftest.pytest_xdist_make_scheduler(two_workers, None)._split_scope
    assert scope("tests/test_cli.py::test_a") == scope("tests/test_export.py::test_b[post-LN]")
    assert scope("tests/test_translation_pipeline.py::test_a") == scope(
        "tests/test_deployment.py::test_b")
    assert scope("tests/test_cli.py::test_a") != scope("tests/test_deployment.py::test_b")
    assert scope("tests/test_model.py::test_a") == scope("tests/test_model.py::test_b[1-2]")
    assert len({scope(f"tests/{name}::test_a") for name in
                ("test_model.py", "test_attention.py", "test_cli.py")}) == 3
