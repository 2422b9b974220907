"""torchrun and SLURM's srun start fairseq-train's ranks on CPUs as they do on GPUs.

fairseq 0.12 reads a launcher's environment only with GPUs in mind (fairseq #4302, #4164):
fairseq-fixed 0.12.3 under torchrun returns early when its default world size (the CUDA device
count, at least 1) is 1, so every rank trains alone, silently; given a world size it computes
``rank % torch.cuda.device_count()`` (ZeroDivisionError on a CPU); under srun it takes the ranks
per node from the same count. fairseq 0.12.2 takes torchrun's world but keeps NCCL and
``pytorch_ddp``, which need GPUs. With the plugin loaded, ``call_main`` first reads the launcher's
environment (fairseq_changes.py): on CPUs it sets the world from it, with gloo and fairseq's
``legacy_ddp`` (torch's DDP refuses a CPU model given device ids, which fairseq's
``pytorch_ddp`` passes); on GPUs it leaves fairseq's own behaviour, but refuses a launch in which
each rank would train alone. An explicit ``--distributed-init-method`` is left as given.
"""

import functools
import logging
import os
import random
import subprocess
from typing import NamedTuple, Optional

import torch

from .errors import PluginError

logger = logging.getLogger(__name__)

TORCHRUN_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")


class World(NamedTuple):
    launcher: str  # "torchrun" or "srun"
    size: int
    rank: int
    init_method: str


def torchrun_world() -> Optional[World]:
    """The world torchrun (or torch.distributed.launch) gives this process, if it started it."""
    if not all(name in os.environ for name in TORCHRUN_VARIABLES):
        return None
    return World("torchrun", int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"]), "env://")


def slurm_world(port: int) -> Optional[World]:
    """The world of an srun step (one task a rank), if this process is one of its tasks: rank 0
    on the step's first host listens on ``port`` (else a port drawn from the job's id, the same
    in every task)."""
    nodes = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST")
    tasks = os.environ.get("SLURM_STEP_NUM_TASKS") or os.environ.get("SLURM_NTASKS")
    if nodes is None or tasks is None or "SLURM_PROCID" not in os.environ or int(tasks) == 1:
        return None
    try:
        hosts = subprocess.run(["scontrol", "show", "hostnames", nodes], check=True,
                               capture_output=True, text=True).stdout.split()
    except FileNotFoundError:
        raise PluginError(f"this is a SLURM task ({tasks} tasks on {nodes}), but scontrol is "
                          f"not on PATH to name its first host; run under srun on the cluster")
    if port <= 0:
        port = random.Random(os.environ.get("SLURM_JOB_ID", "0")).randint(10000, 60000)
    return World("srun", int(tasks), int(os.environ["SLURM_PROCID"]), f"tcp://{hosts[0]}:{port}")


def set_world(cfg) -> None:
    """Before fairseq infers its world: take it from torchrun's or srun's environment on CPUs;
    refuse where fairseq would start ranks that each train alone."""
    dist = cfg.distributed_training
    if dist.distributed_init_method is not None or cfg.common.tpu:
        return
    world = torchrun_world() or slurm_world(dist.distributed_port)
    if world is None or world.size == 1:
        return
    on_cpu = cfg.common.cpu or not torch.cuda.is_available()
    if not on_cpu:
        if dist.distributed_world_size == 1:  # fairseq returns early: each rank alone
            raise PluginError(
                f"{world.launcher} started {world.size} ranks but --distributed-world-size is 1 "
                f"(one GPU here), so each rank would train alone; add --distributed-world-size "
                f"{world.size}")
        return  # fairseq's own GPU launch
    if dist.distributed_world_size not in (1, world.size):
        raise PluginError(f"--distributed-world-size {dist.distributed_world_size} but "
                          f"{world.launcher} started {world.size} ranks; leave the flag out or "
                          f"give {world.size}")
    dist.distributed_world_size, dist.distributed_rank = world.size, world.rank
    dist.distributed_init_method = world.init_method
    dist.distributed_no_spawn, dist.device_id = True, 0
    changed = []
    if dist.distributed_backend == "nccl":  # fairseq's default; NCCL needs GPUs
        dist.distributed_backend = "gloo"
        changed.append("--distributed-backend gloo")
    if dist.ddp_backend in ("c10d", "pytorch_ddp"):
        dist.ddp_backend = "legacy_ddp"
        changed.append("--ddp-backend legacy_ddp (torch's DDP takes no device ids on CPUs)")
    logger.info(f"CPU rank {world.rank} of {world.size} from {world.launcher}'s environment "
                f"({world.init_method})" + (f"; {', '.join(changed)}" if changed else ""))


def world_from_launcher(call_main):
    """fairseq.distributed.utils.call_main (fairseq_changes.py)."""

    @functools.wraps(call_main)
    def wrapper(cfg, main, **kwargs):
        set_world(cfg)
        return call_main(cfg, main, **kwargs)

    return wrapper
