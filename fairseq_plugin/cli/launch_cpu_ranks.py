"""Start N local CPU ranks of fairseq-train: validate a distributed set-up without GPUs.

fairseq's own launchers assume CUDA (spawn starts cuda.device_count() = 0 processes on CPU;
torchrun divides by it). By hand this works, and is what this script does, once per rank R:

  fairseq-train ... --distributed-world-size N --distributed-rank R
      --distributed-init-method tcp://127.0.0.1:PORT --distributed-no-spawn
      --distributed-backend gloo --ddp-backend legacy_ddp --device-id 0 --cpu

Usage:
  annotated-launch-cpu-ranks --nprocs 2 -- fairseq-train DATA --user-dir fairseq_plugin --arch ...
Rank 0's output is shown; rank R's goes to --log-dir/rank{R}.log. If a rank fails, the others
are stopped and the exit status is the failed rank's.
"""

import argparse
import os
import shutil
import socket
import subprocess
import sys
import time


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


def launch(command, nprocs, log_dir, port=None, threads=None, cpu=True, ddp_backend="legacy_ddp"):
    """Run the ranks; return the exit status (0 when every rank succeeded).

    cpu=False leaves out --cpu: every rank then trains on GPU 0, where fairseq's c10d wrapper
    (torch's DDP, which refuses CPU models with device ids) works too. The GPU tests use it to
    run two ranks on one GPU (gloo; NCCL wants a GPU per rank)."""
    port = port or free_port()
    os.makedirs(log_dir, exist_ok=True)
    env = dict(os.environ)
    # share the cores between the ranks instead of oversubscribing them (an explicit --threads
    # wins over OMP_NUM_THREADS in the environment, which wins over the default)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nprocs)))
    procs, logs = [], []
    for rank in range(nprocs):
        out = None
        if rank > 0:
            logs.append(open(os.path.join(log_dir, f"rank{rank}.log"), "w"))
            out = logs[-1]
        cmd = rank_command(command, rank, nprocs, port, cpu, ddp_backend)
        procs.append(subprocess.Popen(cmd, env=env, stdout=out,
                                      stderr=subprocess.STDOUT if out else None))
    status = 0
    try:
        while procs:
            for p in list(procs):
                code = p.poll()
                if code is None:
                    continue
                procs.remove(p)
                if code != 0 and status == 0:
                    status = code
                    sys.stderr.write(f"annotated-launch-cpu-ranks: error: a rank exited with status {code}; "
                                     f"stopping the others (logs in {log_dir})\n")
                    for other in procs:
                        other.terminate()
            time.sleep(0.2)
    finally:
        for p in procs:
            p.kill()
        for f in logs:
            f.close()
    return status


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                usage="%(prog)s [options] -- fairseq-train DATA ...")
    p.add_argument("--nprocs", type=int, default=2, help="number of ranks")
    p.add_argument("--port", type=int, help="TCP port on 127.0.0.1 (default: a free one)")
    p.add_argument("--threads", type=int, help="torch threads per rank (default: cores / N)")
    p.add_argument("--log-dir", default="distributed-logs", help="where rank R>0 logs go")
    split = argv.index("--") if "--" in argv else len(argv)
    args = p.parse_args(argv[:split])  # -h / --help stops here
    command = argv[split + 1:]
    if not command:
        p.error("give the command after --, e.g. annotated-launch-cpu-ranks --nprocs 2 -- "
                "fairseq-train DATA --arch ...")
    if args.nprocs < 1:
        p.error("--nprocs must be at least 1")
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads {args.threads}: give at least 1 thread per rank")
    if shutil.which(command[0]) is None:
        p.error(f"{command[0]}: no such command; check its spelling (e.g. fairseq-train) and "
                f"that its environment is active")
    sys.exit(launch(command, args.nprocs, args.log_dir, args.port, args.threads))


if __name__ == "__main__":
    main()
