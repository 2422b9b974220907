"""fairseq's distributed training with this plugin, proven on 2 CPU ranks."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from conftest import PLUGIN_DIR, cli, reverse_data_bin
from fairseq_plugin.cli import launch_cpu_ranks

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory):
    return ddp_data_bin(tmp_path_factory)


def ddp_data_bin(tmp_path_factory):
    return reverse_data_bin(tmp_path_factory.mktemp("ddp"), "--train", 1500, "--valid", 100,
                            splits=("train", "valid"))


def train_args(data_bin, save_dir):
    # no dropout: the same batches must give the same numbers however they are spread
    return [sys.executable, os.path.join(HERE, "dump_params_train.py"), str(data_bin),
            "--user-dir", PLUGIN_DIR, "--arch", "annotated_transformer_tiny",
            "--share-all-embeddings", "--dropout", "0", "--criterion", "annotated_label_smoothing",
            "--optimizer", "adam", "--lr-scheduler", "noam", "--warmup-updates", "10",
            "--max-tokens", "500", "--max-update", "12", "--seed", "3",
            "--save-dir", str(save_dir), "--no-epoch-checkpoints", "--no-save-optimizer-state",
            "--log-format", "json", "--log-interval", "1", "--num-workers", "0",
            "--disable-validation"]


def training_losses(log_text):
    losses = {}
    for line in log_text.splitlines():
        start = line.find("{")
        if "train_inner" in line and start >= 0:
            entry = json.loads(line[start:])
            losses[int(entry["num_updates"])] = float(entry["loss"])
    return losses


def check_two_ranks_equal_one_rank_with_update_freq_2(data_bin, tmp_path, capfd, cpu=True,
                                                    ddp_backend="legacy_ddp"):
    """Two gloo ranks (on the CPU, or both on GPU 0) against one rank with --update-freq 2."""
    single = cli(*train_args(data_bin, tmp_path / "single"), "--update-freq", "2",
                 *(["--cpu"] if cpu else []))
    status = launch_cpu_ranks.launch(train_args(data_bin, tmp_path / "ddp"), nprocs=2,
                                     log_dir=str(tmp_path / "logs"), cpu=cpu,
                                     ddp_backend=ddp_backend)
    rank0_out = capfd.readouterr()
    assert status == 0, rank0_out.err[-3000:]
    one, two = training_losses(single.stdout + single.stderr), training_losses(rank0_out.out +
                                                                               rank0_out.err)
    assert sorted(one) == sorted(two) == list(range(1, 13))
    assert all(abs(one[k] - two[k]) <= 1e-3 for k in one), (one, two)
    assert len(set(one.values())) > 1  # really training

    rank0 = torch.load(tmp_path / "ddp" / "params_rank0.pt")
    rank1 = torch.load(tmp_path / "ddp" / "params_rank1.pt")
    assert set(rank0) == set(rank1)
    for k in rank0:
        assert torch.equal(rank0[k], rank1[k]), k
    # and the same model as one rank, up to the order of floating-point sums (all-reduce vs
    # accumulation) amplified by 12 Adam steps at a learning rate up to 0.04
    reference = torch.load(tmp_path / "single" / "params_rank0.pt")
    assert max((rank0[k] - reference[k]).abs().max().item() for k in rank0) < 1e-3


def test_two_ranks_equal_one_rank_with_update_freq_2(data_bin, tmp_path, capfd):
    check_two_ranks_equal_one_rank_with_update_freq_2(data_bin, tmp_path, capfd)


@pytest.mark.parametrize("rank1_ignores_sigterm", [False, True])
def test_a_failing_rank_stops_the_others_and_the_launch_fails(rank1_ignores_sigterm, tmp_path,
                                                              capfd, monkeypatch):
    # rank 0 fails at once; rank 1 would wait a minute (as a rank blocked in an all-reduce), and
    # may not even stop when asked to: it is then killed after the grace period
    monkeypatch.setattr(launch_cpu_ranks, "STOP_GRACE_SECONDS", 1)
    ready = tmp_path / "rank1-ready"  # rank 0 fails once rank 1 ignores SIGTERM, if it does
    child = ("import os, signal, sys, time; "
             "rank = int(sys.argv[sys.argv.index('--distributed-rank') + 1]); "
             + ("signal.signal(signal.SIGTERM, signal.SIG_IGN); " if rank1_ignores_sigterm
                else "")
             + f"ready = {str(ready)!r}; "
             "open(ready, 'w').close() if rank else None; "
             "[time.sleep(0.05) for _ in range(600) if not os.path.exists(ready)]; "
             "time.sleep(60) if rank else sys.exit(3)")
    start = time.monotonic()
    status = launch_cpu_ranks.launch([sys.executable, "-c", child], nprocs=2,
                                     log_dir=str(tmp_path))
    elapsed = time.monotonic() - start
    assert status == 3
    assert elapsed < 15  # rank 1 was stopped, not waited for
    if rank1_ignores_sigterm:  # stopped by SIGKILL after the grace period
        assert elapsed >= 1
    assert capfd.readouterr().err.endswith(
        "error: rank 0 exited with status 3; stopping the others (its output: above)\n")


def test_a_failure_is_announced_only_once_a_signal_cannot_cut_the_stop_short(tmp_path,
                                                                               monkeypatch):
    """The error line "stopping the others" is written with SIGTERM already held, so that a
    SIGTERM sent on reading it waits until the ranks are reaped (written before, a SIGTERM that
    came at once could end the launcher with a rank left running)."""
    handlers = []

    class Recording:
        def write(self, text):
            if "stopping the others" in text:
                handlers.append(signal.getsignal(signal.SIGTERM))

        def flush(self):
            pass
    monkeypatch.setattr(sys, "stderr", Recording())
    before = signal.getsignal(signal.SIGTERM)
    status = launch_cpu_ranks.launch([sys.executable, "-c", "import sys; sys.exit(3)"],
                                     nprocs=2, log_dir=str(tmp_path))
    assert status == 3
    assert len(handlers) == 1 and handlers[0] is not before  # held while it was written
    assert signal.getsignal(signal.SIGTERM) is before  # and restored


def test_a_rank_killed_by_a_signal_is_named_with_its_log_and_the_shells_status(tmp_path, capfd,
                                                                             monkeypatch):
    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)  # the launcher sets it for the ranks
    child = ("import os, signal, sys, time; "
             "rank = int(sys.argv[sys.argv.index('--distributed-rank') + 1]); "
             "print('rank', rank, 'about to die'); "
             "os.kill(os.getpid(), signal.SIGKILL) if rank else time.sleep(60)")
    status = launch_cpu_ranks.launch([sys.executable, "-c", child], nprocs=2,
                                     log_dir=str(tmp_path))
    assert status == 128 + 9  # as a shell reports a process killed by SIGKILL
    log = tmp_path / "rank1.log"
    assert capfd.readouterr().err.endswith(
        f"error: rank 1 was killed by SIGKILL (out of memory?); stopping the others (its "
        f"output: {log})\n")
    assert log.read_text() == "rank 1 about to die\n"  # unbuffered: nothing lost with the rank


def test_the_rank_that_ended_first_is_named_though_another_fails_right_after(tmp_path, capfd):
    """Rank 1 dies; rank 0, which waited for it, fails 50 ms later (as in an all-reduce): rank 1
    is the one named, and its status is the launcher's."""
    done = tmp_path / "rank1-done"
    child = ("import os, sys, time; "
             "rank = int(sys.argv[sys.argv.index('--distributed-rank') + 1]); "
             f"done = {str(done)!r}; "
             "(open(done, 'w').close(), sys.exit(5)) if rank else None; "
             "[time.sleep(0.01) for _ in range(3000) if not os.path.exists(done)]; "
             "time.sleep(0.05); sys.exit(7)")
    assert launch_cpu_ranks.launch([sys.executable, "-c", child], nprocs=2,
                                   log_dir=str(tmp_path)) == 5
    assert "error: rank 1 exited with status 5; stopping the others" in capfd.readouterr().err


def start_launcher(tmp_path, child, **popen):
    """The launcher in a process of its own, as a user runs it: 2 ranks running ``child``."""
    return subprocess.Popen(
        [sys.executable, "-m", "fairseq_plugin.cli.launch_cpu_ranks", "--nprocs", "2",
         "--log-dir", str(tmp_path / "logs"), "--", sys.executable, "-c", child],
        cwd=REPO, **popen)


def wait_for_files(files, launcher):
    """Until every rank has written its file, the launcher still running."""
    deadline = time.monotonic() + 60
    while not all(f.exists() and f.read_text() for f in files):
        assert launcher.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)


def test_a_second_sigterm_while_the_ranks_stop_leaves_none_running(tmp_path):
    """Rank 0 fails, rank 1 ignores SIGTERM; a SIGTERM to the launcher during the grace period
    does not cut the stop short: rank 1 is still killed and reaped."""
    child = ("import os, signal, sys, time; "
             "rank = sys.argv[sys.argv.index('--distributed-rank') + 1]; "
             "signal.signal(signal.SIGTERM, signal.SIG_IGN); "
             f"open(os.path.join({str(tmp_path)!r}, 'pid' + rank), 'w').write(str(os.getpid())); "
             f"[time.sleep(0.05) for _ in range(600) "
             f"if not os.path.exists(os.path.join({str(tmp_path)!r}, 'pid1'))]; "
             "time.sleep(60) if rank == '1' else sys.exit(3)")
    launcher = start_launcher(tmp_path, child, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    err = ""
    while "stopping the others" not in err:  # rank 0 has failed: the grace period runs
        assert time.monotonic() < deadline
        err += launcher.stderr.readline()
    launcher.send_signal(signal.SIGTERM)
    launcher.wait(timeout=30)
    with pytest.raises(ProcessLookupError):
        os.kill(int((tmp_path / "pid1").read_text()), 0)


def test_under_nohup_a_hangup_stops_neither_the_launcher_nor_its_ranks(tmp_path):
    """SIGHUP ignored when the launcher starts (nohup) stays ignored, in it and in its ranks."""
    child = ("import os, signal, sys, time; "
             "rank = sys.argv[sys.argv.index('--distributed-rank') + 1]; "
             f"open(os.path.join({str(tmp_path)!r}, 'hup' + rank), 'w')"
             ".write(str(signal.getsignal(signal.SIGHUP))); time.sleep(2)")
    launcher = start_launcher(tmp_path, child,
                              preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    files = [tmp_path / "hup0", tmp_path / "hup1"]
    wait_for_files(files, launcher)
    launcher.send_signal(signal.SIGHUP)
    assert launcher.wait(timeout=30) == 0
    assert [f.read_text() for f in files] == [str(signal.SIG_IGN)] * 2


def test_stopping_the_launcher_stops_every_rank(tmp_path):
    """SIGTERM (a scheduler, `timeout`) to the launcher reaches its ranks: none is left running."""
    child = ("import os, sys, time; "
             "rank = sys.argv[sys.argv.index('--distributed-rank') + 1]; "
             f"open(os.path.join({str(tmp_path)!r}, 'pid' + rank), 'w').write(str(os.getpid())); "
             "time.sleep(60)")
    launcher = start_launcher(tmp_path, child)
    pid_files = [tmp_path / "pid0", tmp_path / "pid1"]
    wait_for_files(pid_files, launcher)
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=30) == 128 + signal.SIGTERM
    for f in pid_files:
        with pytest.raises(ProcessLookupError):  # stopped and reaped
            os.kill(int(f.read_text()), 0)


@pytest.mark.parametrize("environment, threads, expected", [
    (None, None, str(max(1, len(os.sched_getaffinity(0)) // 2))),  # the cores, shared by 2 ranks
    ("5", None, "5"),                                       # the user's OMP_NUM_THREADS
    ("5", 3, "3")])                                         # an explicit --threads wins
def test_each_rank_gets_the_threads_asked_for(environment, threads, expected, tmp_path,
                                              monkeypatch):
    if environment is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", environment)
    child = ("import os, sys; rank = sys.argv[sys.argv.index('--distributed-rank') + 1]; "
             f"open(os.path.join({str(tmp_path)!r}, 'threads' + rank), 'w')"
             ".write(os.environ['OMP_NUM_THREADS'])")
    assert launch_cpu_ranks.launch([sys.executable, "-c", child], nprocs=2,
                                   log_dir=str(tmp_path), threads=threads) == 0
    assert [(tmp_path / f"threads{rank}").read_text() for rank in (0, 1)] == [expected] * 2


def test_the_launcher_has_help_and_names_a_missing_command_in_one_line(capsys):
    with pytest.raises(SystemExit) as help_exit:
        launch_cpu_ranks.main(["--help"])
    assert help_exit.value.code == 0 and "-- fairseq-train DATA" in capsys.readouterr().out
    with pytest.raises(SystemExit) as error_exit:
        launch_cpu_ranks.main(["--nprocs", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert error_exit.value.code == 2
    assert err[-1].endswith("error: give the command after --, e.g. annotated-launch-cpu-ranks "
                            "--nprocs 2 -- fairseq-train DATA --arch ...")
    with pytest.raises(SystemExit) as error_exit:
        launch_cpu_ranks.main(["--nprocs", "2", "--", "fairseq-trian", "DATA"])
    assert error_exit.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "error: fairseq-trian: no such command; check its spelling (e.g. fairseq-train) and that "
        "its environment is active")


@pytest.mark.parametrize("argv, message", [
    (["--nprocs", "2", "fairseq-train", "DATA"],
     "fairseq-train DATA: not the launcher's options; put the command after --, e.g. "
     "annotated-launch-cpu-ranks --nprocs 2 -- fairseq-train DATA --arch ..."),
    (["--", sys.executable, "train.py", "--distributed-world-size", "4"],
     "--distributed-world-size: the launcher sets it for every rank; leave it out of the command "
     "(use the launcher's --nprocs)"),
    (["--", sys.executable, "train.py", "--ddp-backend=c10d"],
     "--ddp-backend: the launcher sets it for every rank; leave it out of the command (the "
     "launcher's ranks use legacy_ddp (c10d refuses CPU models))"),
    (["--port", "99999", "--", sys.executable],
     "argument --port: 99999 is not a TCP port; give one in 1-65535"),
    (["--port", "{busy}", "--", sys.executable],
     "--port {busy}: Address already in use; give another port, or leave --port out for a free "
     "one"),
    (["--log-dir", "{file}", "--", sys.executable],
     "--log-dir {file}: cannot make a folder there (File exists); give another path"),
    (["--log-dir", "{tmp}", "--", "{script}"],
     "cannot start the ranks: {script}: Exec format error; run a script as: python script.py "
     "..."),
    (["--", sys.executable, "train.py", "--local_rank", "1"],
     "--local_rank: the launcher sets it for every rank; leave it out of the command (every CPU "
     "rank is device 0)"),
])
def test_the_launchers_bad_input_gets_one_line_before_any_rank_starts(argv, message, tmp_path,
                                                                      capsys):
    (tmp_path / "a_file").write_text("")
    script = tmp_path / "train.py"  # executable, but no #! line
    script.write_text("print('trained')\n")
    script.chmod(0o755)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        values = dict(busy=busy.getsockname()[1], file=tmp_path / "a_file", tmp=tmp_path,
                      script=script)
        with pytest.raises(SystemExit) as error_exit:
            launch_cpu_ranks.main([arg.format(**values) for arg in argv])
    assert error_exit.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "annotated-launch-cpu-ranks: error: " + message.format(**values)
