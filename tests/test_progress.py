"""Long steps show progress while they run, not when they end."""

import io
import os
import re
import shlex
import subprocess
import sys
import time

import pytest

from fairseq_plugin.cli.common import (Progress, fairseq_validation, generation_progress, run,
                                       training_progress)
from fairseq_plugin.errors import PluginError
from fairseq_plugin.cli.follow import follow

LINE = ("2026-11-23 05:00:00 | INFO | train_inner | epoch 002:     40 / 160 loss=5.1, "
        "nll_loss=4.2, ppl=18.4, wps=4900, ups=2.50, wpb=1960, num_updates=200, lr=0.0005")


def test_a_training_interval_becomes_a_progress_line_with_speed_and_time_left():
    assert training_progress(LINE, epochs=5) == (
        "epoch 2: update 40/160, 2.50 updates/s, about 4.0 min left in all")
    assert training_progress(LINE) == (
        "epoch 2: update 40/160, 2.50 updates/s, about 0.8 min left in this epoch")
    assert training_progress("2026 | INFO | valid | epoch 002 | valid on 'valid' subset") is None


def test_the_runner_echoes_a_line_before_the_child_exits(tmp_path, monkeypatch):
    # the child writes to a pipe without flushing: only an unbuffered child shows it at once
    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)
    child = f"import time; print({LINE!r}); time.sleep(3); print('done')"
    seen = []
    start = time.monotonic()
    run([sys.executable, "-c", child], tmp_path / "train.log", epochs=5,
        echo=lambda text, flush=True: seen.append((time.monotonic() - start, text)))
    finished = time.monotonic() - start
    progress = [(t, text) for t, text in seen if "updates/s" in text]
    assert len(progress) == 1
    assert progress[0][0] < finished - 2.0  # shown about 3 s before the child exits
    assert (tmp_path / "train.log").read_text().splitlines() == [LINE, "done"]


VALID_LINE = ("2026-11-23 05:00:00 | INFO | valid | epoch 002 | valid on 'valid' subset | "
              "loss 4.1 | bleu 12.3")


def test_the_runner_echoes_the_lines_its_show_function_picks_and_logs_every_line(tmp_path):
    child = f"print('noise'); print({VALID_LINE!r})"
    seen = []
    run([sys.executable, "-c", child], tmp_path / "train.log", show=fairseq_validation,
        echo=lambda text, flush=True: seen.append(text))
    assert seen[1:] == ["  epoch 002 | valid on 'valid' subset | loss 4.1 | bleu 12.3"]
    assert (tmp_path / "train.log").read_text().splitlines() == ["noise", VALID_LINE]


def test_a_failed_command_is_one_plugin_error_naming_its_log_which_holds_its_output(
        tmp_path, monkeypatch):
    child = "import sys; print('what went wrong'); sys.exit(3)"
    monkeypatch.chdir(tmp_path)  # a relative log path is named absolute in the error
    (tmp_path / "logs").mkdir()
    with pytest.raises(PluginError) as error:
        run([sys.executable, "-c", child], os.path.join("logs", "train.log"),
            echo=lambda *a, **k: None)
    log = tmp_path / "logs" / "train.log"
    assert re.fullmatch(r"python\S* failed \(exit 3\); see (.*)", str(error.value)).group(1) == str(log)
    assert log.read_text() == "what went wrong\n"


GENERATE_LINE = "2026-11-23 05:00:00 | INFO | fairseq_cli.generate | :      3 / 12 wps=1500"


def test_a_generation_batch_becomes_a_progress_line_with_time_left():
    assert generation_progress(GENERATE_LINE, seconds=30.0) == (
        "batch 3/12, 1500 target tokens/s, about 1.5 min left")
    assert generation_progress(LINE, seconds=30.0) is None  # a training interval
    assert generation_progress("S-3\tein Satz", seconds=1.0) is None


def test_the_runner_shows_generation_progress_while_translations_go_to_their_file(tmp_path):
    child = ("import sys, time; print('H-0\\tfirst'); "
             f"print({GENERATE_LINE!r}, file=sys.stderr); sys.stderr.flush(); time.sleep(3); "
             "print('H-1\\tsecond')")
    seen = []
    start = time.monotonic()
    run([sys.executable, "-c", child], tmp_path / "generate.log",
        output_path=tmp_path / "generate.txt",
        echo=lambda text, flush=True: seen.append((time.monotonic() - start, text)))
    finished = time.monotonic() - start
    progress = [(t, text) for t, text in seen if text.startswith("  batch 3/12")]
    assert len(progress) == 1 and progress[0][0] < finished - 2.0
    assert (tmp_path / "generate.txt").read_text().splitlines() == ["H-0\tfirst", "H-1\tsecond"]
    assert (tmp_path / "generate.log").read_text().splitlines() == [GENERATE_LINE]


def test_progress_in_a_log_shows_rate_and_time_left_while_it_runs_and_a_line_at_the_end():
    out = io.StringIO()  # not a terminal
    with Progress("tokenise train.de", total=10, every=0.0, file=out) as shown:
        time.sleep(0.01)
        shown.update(4)
        assert re.fullmatch(r"tokenise train\.de: 4/10 lines, [\d,]+ lines/s, about \d+ s left\n",
                            out.getvalue())
        shown.update(6)
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and re.fullmatch(r"tokenise train\.de: 10 lines in \d+\.\d s", lines[2])


def test_progress_in_a_log_waits_its_interval_between_lines():
    out = io.StringIO()
    shown = Progress("learn BPE", total=500, unit="merges", every=60.0, file=out)
    for _ in range(500):
        shown.update()
    assert out.getvalue() == ""
    shown.close()
    assert out.getvalue().startswith("learn BPE: 500 merges in ")


def test_follow_adds_the_time_left_after_each_training_interval():
    out = io.StringIO()
    follow(["begin training epoch 2\n", LINE + "\n", "done\n"], out, epochs=5)
    assert out.getvalue().splitlines() == [
        "begin training epoch 2", LINE,
        "  epoch 2: update 40/160, 2.50 updates/s, about 4.0 min left in all", "done"]


def test_a_piped_training_log_shows_its_progress_while_the_child_runs():
    # examples/multi30k/run.sh: PYTHONUNBUFFERED=1 fairseq-train ... | tee LOG | ...cli.follow;
    # the child starts slowly, as fairseq-train does, while the filter imports the plugin
    child = f"import time; time.sleep(8); print({LINE!r}); time.sleep(3); print('done')"
    pipeline = (f"PYTHONUNBUFFERED=1 {shlex.quote(sys.executable)} -c {shlex.quote(child)} | "
                f"{shlex.quote(sys.executable)} -m fairseq_plugin.cli.follow --epochs 5")
    start = time.monotonic()
    proc = subprocess.Popen(["bash", "-c", pipeline], stdout=subprocess.PIPE, text=True,
                            env={k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"})
    seen = [(time.monotonic() - start, line.rstrip("\n")) for line in proc.stdout]
    finished = time.monotonic() - start
    assert proc.wait() == 0
    progress = [t for t, line in seen if "updates/s, about 4.0 min left in all" in line]
    assert len(progress) == 1 and progress[0] < finished - 2.0
    assert seen[-1][1] == "done"
