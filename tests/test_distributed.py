"""fairseq's distributed training with this plugin, started as fairseq users start it: torchrun
(two node ranks on this one host) and SLURM's srun (two tasks with the environment srun gives
them, a stand-in scontrol on PATH), each proven equal to one rank with --update-freq 2."""

import json
import os
import socket
import subprocess
import sys
from types import SimpleNamespace

import fairseq
import pytest
import torch
from fairseq.distributed import utils as distributed_utils

from conftest import PLUGIN_DIR, cli, reverse_data_bin
from fairseq_plugin import PluginError, fairseq_changes, launch

HERE = os.path.dirname(os.path.abspath(__file__))
ONE_THREAD = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory):
    return ddp_data_bin(tmp_path_factory)


def ddp_data_bin(tmp_path_factory):
    return reverse_data_bin(tmp_path_factory.mktemp("ddp"), "--train", 1500, "--valid", 100,
                            splits=("train", "valid"))


def train_args(data_bin, save_dir):
    # no dropout: the same batches must give the same numbers however they are spread
    return [os.path.join(HERE, "dump_params_train.py"), str(data_bin),
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_node(node_rank, nnodes, nproc, port, args, log, env=ONE_THREAD):
    """One node's torchrun (its output in ``log``), started now."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes),
               "--nproc-per-node", str(nproc), "--node-rank", str(node_rank),
               "--master-addr", "127.0.0.1", "--master-port", str(port), *args]
    with open(log, "w") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)


def srun_task(rank, ntasks, bin_dir, args, log):
    """One task of an srun step over ``ntasks`` nodes (one task each), as srun starts it: its
    environment, and scontrol on PATH naming the step's hosts (all this one)."""
    env = dict(ONE_THREAD, SLURM_JOB_ID="4242", SLURM_JOB_NODELIST=f"node[1-{ntasks}]",
               SLURM_STEP_NODELIST=f"node[1-{ntasks}]", SLURM_NNODES=str(ntasks),
               SLURM_NTASKS=str(ntasks), SLURM_STEP_NUM_TASKS=str(ntasks),
               SLURM_NTASKS_PER_NODE="1", SLURM_NODEID=str(rank), SLURM_PROCID=str(rank),
               SLURM_LOCALID="0", PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, *args], stdout=out, stderr=subprocess.STDOUT,
                                env=env)


def stand_in_scontrol(folder):
    """``scontrol show hostnames LIST``: every host of the list is this one."""
    folder.mkdir(exist_ok=True)
    script = folder / "scontrol"
    script.write_text("#!/bin/sh\n# scontrol show hostnames node[1-N]: this host, N times\n"
                      "n=$(echo \"$3\" | sed 's/.*-\\([0-9]*\\)]/\\1/'); "
                      "for i in $(seq \"$n\"); do echo 127.0.0.1; done\n")
    script.chmod(0o755)
    return folder


def wait_all(procs, logs, timeout=600):
    for proc, log in zip(procs, logs):
        try:
            status = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise AssertionError(f"still running after {timeout} s:\n{log.read_text()[-3000:]}")
        assert status == 0, log.read_text()[-4000:]
    return [log.read_text() for log in logs]


def check_equal_to_one_rank_with_update_freq_2(data_bin, tmp_path, rank0_output, save_dir,
                                               device_flags=("--cpu",)):
    """Two ranks' losses and parameters against one rank with --update-freq 2."""
    single = cli(sys.executable, *train_args(data_bin, tmp_path / "single"), "--update-freq",
                 "2", *device_flags, env=ONE_THREAD)
    one, two = training_losses(single.stdout + single.stderr), training_losses(rank0_output)
    assert sorted(one) == sorted(two) == list(range(1, 13)), rank0_output[-3000:]
    assert all(abs(one[k] - two[k]) <= 1e-3 for k in one), (one, two)
    assert len(set(one.values())) > 1  # really training

    rank0 = torch.load(save_dir / "params_rank0.pt")
    rank1 = torch.load(save_dir / "params_rank1.pt")
    assert set(rank0) == set(rank1)
    for k in rank0:
        assert torch.equal(rank0[k], rank1[k]), k
    # and the same model as one rank, up to the order of floating-point sums (all-reduce vs
    # accumulation) amplified by 12 Adam steps at a learning rate up to 0.04
    reference = torch.load(tmp_path / "single" / "params_rank0.pt")
    assert max((rank0[k] - reference[k]).abs().max().item() for k in rank0) < 1e-3


def test_torchrun_two_node_ranks_on_cpus_equal_one_rank_with_update_freq_2(data_bin, tmp_path):
    """`torchrun --nnodes 2 --nproc-per-node 1 --node-rank R ... fairseq-train ... --cpu`, no
    distributed flag: fairseq 0.12 alone would train two independent runs."""
    port, save = free_port(), tmp_path / "ddp"
    args = [*train_args(data_bin, save), "--cpu"]
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    procs = [torchrun_node(r, 2, 1, port, args, logs[r]) for r in (0, 1)]
    rank0, _ = wait_all(procs, logs)
    assert "CPU rank 0 of 2 from torchrun's environment (env://)" in rank0
    # both ranks ran on this host with one save-dir: only the saving rank locked it (run_dir.py),
    # or the other would have been refused
    assert (save / ".fairseq-train.lock").read_text().startswith("pid ")
    check_equal_to_one_rank_with_update_freq_2(data_bin, tmp_path, rank0, save)


def test_srun_two_tasks_on_cpus_equal_one_rank_with_update_freq_2(data_bin, tmp_path):
    """Two tasks with the environment `srun --nodes 2 --ntasks-per-node 1` gives them."""
    port, save = free_port(), tmp_path / "ddp"
    bin_dir = stand_in_scontrol(tmp_path / "bin")
    args = [*train_args(data_bin, save), "--cpu", "--distributed-port", str(port)]
    logs = [tmp_path / "task0.log", tmp_path / "task1.log"]
    procs = [srun_task(r, 2, bin_dir, args, logs[r]) for r in (0, 1)]
    rank0, _ = wait_all(procs, logs)
    assert f"CPU rank 0 of 2 from srun's environment (tcp://127.0.0.1:{port})" in rank0
    check_equal_to_one_rank_with_update_freq_2(data_bin, tmp_path, rank0, save)


def config(cpu=True, world_size=1, init_method=None, port=-1):
    dist = SimpleNamespace(distributed_init_method=init_method, distributed_world_size=world_size,
                           distributed_rank=0, distributed_port=port, distributed_no_spawn=False,
                           device_id=0, distributed_backend="nccl", ddp_backend="pytorch_ddp",
                           pipeline_model_parallel=False, tpu=False)
    return SimpleNamespace(distributed_training=dist, common=SimpleNamespace(cpu=cpu, tpu=False))


TORCHRUN_2 = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "WORLD_SIZE": "2",
              "RANK": "1", "LOCAL_RANK": "0"}


def test_without_the_change_fairseq_trains_each_torchrun_rank_alone_on_cpus(monkeypatch):
    for name, value in TORCHRUN_2.items():
        monkeypatch.setenv(name, value)
    cfg = config()
    distributed_utils.infer_init_method(cfg.distributed_training)  # fairseq's own
    dist = cfg.distributed_training
    if fairseq.__version__ == "0.12.2":  # the world, but NCCL and DDP's device ids: GPUs only
        assert (dist.distributed_init_method, dist.distributed_world_size,
                dist.distributed_backend, dist.ddp_backend) == ("env://", 2, "nccl",
                                                                 "pytorch_ddp")
    else:  # fairseq-fixed 0.12.3: its default world size 1 returns first: each rank alone
        assert dist.distributed_init_method is None
    cfg = config()
    launch.set_world(cfg)  # the change
    assert (cfg.distributed_training.distributed_world_size,
            cfg.distributed_training.distributed_rank,
            cfg.distributed_training.distributed_init_method,
            cfg.distributed_training.distributed_backend,
            cfg.distributed_training.ddp_backend) == (2, 1, "env://", "gloo", "legacy_ddp")
    assert fairseq_changes.installed("launchers_environment_on_cpu")


@pytest.mark.parametrize("cpu, world_size, message", [
    (False, 1, "torchrun started 2 ranks but --distributed-world-size is 1 (one GPU here), so "
               "each rank would train alone; add --distributed-world-size 2"),
    (True, 4, "--distributed-world-size 4 but torchrun started 2 ranks; leave the flag out or "
              "give 2"),
])
def test_a_launch_that_would_train_copies_alone_or_mismatch_is_refused_in_one_line(
        monkeypatch, cpu, world_size, message):
    for name, value in TORCHRUN_2.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: not cpu)
    with pytest.raises(PluginError) as error:
        launch.set_world(config(cpu=cpu, world_size=world_size))
    assert str(error.value) == message


def test_gpu_ranks_keep_fairseqs_own_launch(monkeypatch):
    for name, value in TORCHRUN_2.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = config(cpu=False, world_size=2)
    launch.set_world(cfg)
    assert cfg.distributed_training.distributed_init_method is None  # left to fairseq
    assert cfg.distributed_training.distributed_backend == "nccl"


def test_an_explicit_init_method_and_a_single_task_are_left_alone(monkeypatch):
    cfg = config(init_method="tcp://10.0.0.1:1234")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node1")
    monkeypatch.setenv("SLURM_NTASKS", "1")
    monkeypatch.setenv("SLURM_PROCID", "0")
    for c in (cfg, config()):
        launch.set_world(c)
    assert cfg.distributed_training.distributed_init_method == "tcp://10.0.0.1:1234"
