"""Start N local CPU ranks of fairseq-train: validate a distributed set-up without GPUs.

fairseq's own launchers assume CUDA (spawn starts cuda.device_count() = 0 processes on CPU;
torchrun divides by it). By hand this works, and is what this script does, once per rank R:

  fairseq-train ... --distributed-world-size N --distributed-rank R
      --distributed-init-method tcp://127.0.0.1:PORT --distributed-no-spawn
      --distributed-backend gloo --ddp-backend legacy_ddp --device-id 0 --cpu

Usage:
  annotated-launch-cpu-ranks --nprocs 2 -- fairseq-train DATA --user-dir fairseq_plugin --arch ...
Rank 0's output is shown; rank R's goes to --log-dir/rank{R}.log. If a rank fails, the others
are stopped and the exit status is the failed rank's; if the launcher is stopped (Ctrl-C,
SIGTERM, SIGHUP), so are the ranks.
"""

import argparse
import errno
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Tuple

PROG = "annotated-launch-cpu-ranks"
STOP_GRACE_SECONDS = 10  # how long a rank asked to stop may take before it is killed

# what the launcher sets on each rank's command, and what to use instead of setting it yourself
# (fairseq keeps the last value of a repeated flag: the launcher's would silently win)
LAUNCHER_FLAGS = {
    "--distributed-world-size": "use the launcher's --nprocs",
    "--distributed-rank": "the launcher numbers the ranks",
    "--distributed-init-method": "use the launcher's --port",
    "--distributed-backend": "the launcher's ranks use gloo",
    "--ddp-backend": "the launcher's ranks use legacy_ddp (c10d refuses CPU models)",
    "--device-id": "every CPU rank is device 0",
    "--local_rank": "every CPU rank is device 0",  # fairseq's alias of --device-id
}
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)  # ended through SystemExit (main)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_command(command, rank, world_size, port, cpu=True, ddp_backend="legacy_ddp"):
    return [*command,
            "--distributed-world-size", str(world_size), "--distributed-rank", str(rank),
            "--distributed-init-method", f"tcp://127.0.0.1:{port}", "--distributed-no-spawn",
            "--distributed-backend", "gloo", "--ddp-backend", ddp_backend, "--device-id", "0",
            *(["--cpu"] if cpu else [])]


def usable_cores() -> int:
    """The cores this process may run on (a cpuset or taskset limits them), else all."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def launch(command, nprocs, log_dir, port=None, threads=None, cpu=True, ddp_backend="legacy_ddp"):
    """Run the ranks; return the exit status: 0 when every rank succeeded, else the first failed
    rank's (128 + N for a rank killed by signal N, as a shell reports it). However this returns
    (a failure, an exception, SIGTERM turned into SystemExit by ``main``), no rank is left running.

    cpu=False leaves out --cpu: every rank then trains on GPU 0, where fairseq's c10d wrapper
    (torch's DDP, which refuses CPU models with device ids) works too. The GPU tests use it to
    run two ranks on one GPU (gloo; NCCL wants a GPU per rank)."""
    port = port or free_port()
    os.makedirs(log_dir, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")  # a rank's last lines reach its log
    # share the cores between the ranks instead of oversubscribing them (an explicit --threads
    # wins over OMP_NUM_THREADS in the environment, which wins over the default)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    env.setdefault("OMP_NUM_THREADS", str(max(1, usable_cores() // nprocs)))
    procs, logs, failure = [], [], ""
    try:
        for rank in range(nprocs):
            out = None
            if rank > 0:
                logs.append(open(os.path.join(log_dir, f"rank{rank}.log"), "w"))
                out = logs[-1]
            cmd = rank_command(command, rank, nprocs, port, cpu, ddp_backend)
            procs.append(subprocess.Popen(cmd, env=env, stdout=out,
                                          stderr=subprocess.STDOUT if out else None))
        status, failure = wait_for_ranks(procs, log_dir)
        return status
    finally:
        stop(procs, failure)
        for f in logs:
            f.close()


def wait_for_ranks(procs, log_dir) -> Tuple[int, str]:
    """(0, "") once every rank has succeeded; at the first failure, its status and the error line
    that names it (the caller stops the others). Ranks are taken in the order they end (one
    waiting thread each): when one rank dies, the others fail soon after ("Connection closed by
    peer"), and the first is the one to name."""
    ended = queue.Queue()
    for rank, proc in enumerate(procs):
        threading.Thread(target=lambda rank=rank, proc=proc: ended.put((rank, proc.wait())),
                         daemon=True).start()
    for _ in procs:
        while True:
            try:  # (a timeout, so that signals are handled while waiting)
                rank, code = ended.get(timeout=0.2)
                break
            except queue.Empty:
                pass
        if code != 0:
            output = "above" if rank == 0 else os.path.join(log_dir, f"rank{rank}.log")
            return (128 - code if code < 0 else code,
                    f"{PROG}: error: {rank_failure(rank, code)}; stopping the others (its "
                    f"output: {output})\n")
    return 0, ""


def rank_failure(rank: int, code: int) -> str:
    """How rank ``rank`` ended, from its Popen return code (-N: killed by signal N)."""
    if code >= 0:
        return f"rank {rank} exited with status {code}"
    name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
    return (f"rank {rank} was killed by {name}"
            + (" (out of memory?)" if -code == signal.SIGKILL else ""))


def stop(procs, why: str = "") -> None:
    """Ask every rank still running to stop (SIGTERM), kill those still running after
    STOP_GRACE_SECONDS, and reap them all; a Ctrl-C, SIGTERM or SIGHUP meanwhile is held until
    they are, then takes its course. ``why`` (a failure's error line) is written once those
    signals are held: one sent on reading it cannot cut the stop short."""
    held, previous = [], {}
    if threading.current_thread() is threading.main_thread():  # (where handlers can be set)
        for signum in (signal.SIGINT, *STOP_SIGNALS):
            if signal.getsignal(signum) not in (signal.SIG_IGN, None):
                previous[signum] = signal.signal(signum, lambda signum, _: held.append(signum))
    try:
        sys.stderr.write(why)
        stop_now(procs)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if held:
        signal.raise_signal(held[0])


def stop_now(procs) -> None:
    """SIGTERM to the ranks still running, SIGKILL to those left after the grace period."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + STOP_GRACE_SECONDS
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def port_number(text: str) -> int:
    port = int(text)
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a TCP port; give one in 1-65535")
    return port


def exit_on_signal(signum, frame):
    """SIGTERM / SIGHUP (a scheduler, `timeout`, a closed terminal) end the launcher through
    SystemExit, so that ``launch`` stops its ranks on the way out."""
    raise SystemExit(128 + signum)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    example = f"e.g. {PROG} --nprocs 2 -- fairseq-train DATA --arch ..."
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                usage="%(prog)s [options] -- fairseq-train DATA ...")
    p.add_argument("--nprocs", type=int, default=2, help="number of ranks")
    p.add_argument("--port", type=port_number,
                   help="TCP port on 127.0.0.1 (default: a free one)")
    p.add_argument("--threads", type=int, help="torch threads per rank (default: cores / N)")
    p.add_argument("--log-dir", default="distributed-logs", help="where rank R>0 logs go")
    split = argv.index("--") if "--" in argv else len(argv)
    args, unknown = p.parse_known_args(argv[:split])  # -h / --help stops here
    if unknown:
        p.error(f"{' '.join(unknown)}: not the launcher's options; put the command after --, "
                f"{example}")
    command = argv[split + 1:]
    if not command:
        p.error(f"give the command after --, {example}")
    if args.nprocs < 1:
        p.error("--nprocs must be at least 1")
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads {args.threads}: give at least 1 thread per rank")
    if shutil.which(command[0]) is None:
        p.error(f"{command[0]}: no such command; check its spelling (e.g. fairseq-train) and "
                f"that its environment is active")
    for arg in command[1:]:
        flag = arg.split("=", 1)[0]
        if flag in LAUNCHER_FLAGS:
            p.error(f"{flag}: the launcher sets it for every rank; leave it out of the command "
                    f"({LAUNCHER_FLAGS[flag]})")
    if args.port is not None:
        try:
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's store binds
                s.bind(("127.0.0.1", args.port))
        except OSError as e:
            p.error(f"--port {args.port}: {e.strerror}; give another port, or leave --port out "
                    f"for a free one")
    try:
        os.makedirs(args.log_dir, exist_ok=True)
    except OSError as e:
        p.error(f"--log-dir {args.log_dir}: cannot make a folder there ({e.strerror}); give "
                f"another path")
    for signum in STOP_SIGNALS:
        if signal.getsignal(signum) is not signal.SIG_IGN:  # (nohup's SIGHUP stays ignored)
            signal.signal(signum, exit_on_signal)
    try:
        status = launch(command, args.nprocs, args.log_dir, args.port, args.threads)
    except KeyboardInterrupt:  # Ctrl-C reaches the ranks too; launch has reaped them
        status = 128 + signal.SIGINT
    except OSError as e:  # the command, or a rank's log file
        hint = ("run a script as: python script.py ..." if e.errno == errno.ENOEXEC
                else "check the path and its permissions")
        p.error(f"cannot start the ranks: {e.filename or command[0]}: {e.strerror}; {hint}")
    sys.exit(status)


if __name__ == "__main__":
    main()
