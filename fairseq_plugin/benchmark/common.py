"""What the benchmark's parts share: the model sizes (PRESETS), the contestants (CONTESTANTS,
chosen with --contestants), fairseq-train's flags for them, and the order of alternated rounds."""

import argparse
import os
import re
from typing import NamedTuple

from fairseq_plugin.cli.common import plugin_dir

PRESETS = {  # layers, d_model, d_ff, heads
    "default": (4, 256, 1024, 4),
    "tiny": (2, 64, 256, 4),
    "iwslt": (6, 512, 1024, 4),
    "base": (6, 512, 2048, 8),
    "multi30k": (3, 256, 512, 8),  # examples/multi30k's model
}

OURS, THEIRS = "annotated_transformer", "transformer"


class Contestant(NamedTuple):
    """A model in the rounds: its name, its --arch, more flags, the --user-dir it comes from."""
    name: str
    arch: str
    flags: tuple = ()
    user_dir: str = plugin_dir()


CONTESTANTS = {  # --contestants: the list's words
    OURS: Contestant(OURS, OURS),
    THEIRS: Contestant(THEIRS, THEIRS),
    # its fused attention on the backend torch chooses (cuDNN on a GPU), not the default no-cudnn
    "torch-choice": Contestant(f"{OURS} torch-choice", OURS,
                               ("--fused-attention-backends", "torch")),
    # the position-wise work on every position, padding included, as fairseq's transformer does
    "without-packing": Contestant(f"{OURS} without packing", OURS, ("--no-packing",)),
    "compiled": Contestant(f"{OURS} compiled", OURS, ("--compile-layers",)),
}
BEFORE = "before="  # before=PLUGIN_DIR: the annotated_transformer of another checkout


def contestants(text: str):
    """An argparse type: the --contestants list, its words comma-separated, as Contestants."""
    chosen = []
    for word in text.split(","):
        if word.startswith(BEFORE) and os.path.isdir(word[len(BEFORE):]):
            chosen.append(Contestant(f"{OURS}@before", OURS,
                                     user_dir=os.path.abspath(word[len(BEFORE):])))
        elif word in CONTESTANTS:
            chosen.append(CONTESTANTS[word])
        else:
            raise argparse.ArgumentTypeError(
                f"{word!r}: give {', '.join(CONTESTANTS)} or before=PLUGIN_DIR (a checkout's "
                "fairseq_plugin folder), separated by commas")
    names = [c.name for c in chosen]
    if OURS not in names or THEIRS not in names or len(set(names)) < len(names):
        raise argparse.ArgumentTypeError(
            f"{text!r}: {OURS} and {THEIRS} are both needed (the ratios are between them), each "
            "contestant once")
    return chosen


def model_flags(preset):
    layers, d, ff, heads = PRESETS[preset]
    return ["--encoder-layers", layers, "--decoder-layers", layers, "--encoder-embed-dim", d,
            "--decoder-embed-dim", d, "--encoder-ffn-embed-dim", ff, "--decoder-ffn-embed-dim",
            ff, "--encoder-attention-heads", heads, "--decoder-attention-heads", heads,
            "--share-all-embeddings", "--dropout", "0.1"]


def training_flags(data_bin, contestant, preset, max_tokens, device):
    """fairseq-train's arguments: the same for every contestant but its own."""
    return [data_bin, "--user-dir", contestant.user_dir, "--arch", contestant.arch,
            *model_flags(preset), "--criterion", "label_smoothed_cross_entropy",
            "--label-smoothing", "0.1", "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)",
            "--lr", "5e-4", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "100",
            "--max-tokens", max_tokens, "--seed", "1", *device.flags(), "--num-workers", "0",
            *contestant.flags]


def fairseq_setup(flags):
    """(fairseq's configuration, its task) from fairseq-train's ``flags``, set up in this process
    as fairseq-train sets them up (the --user-dir imported)."""
    from fairseq import options, tasks, utils
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    args = options.parse_args_and_arch(options.get_training_parser(), [str(f) for f in flags])
    cfg = convert_namespace_to_omegaconf(args)
    utils.import_user_module(cfg.common)
    return cfg, tasks.setup_task(cfg.task)


def folder_name(name: str) -> str:
    """A contestant's name as a folder name (annotated_transformer-torch-choice, ...)."""
    return re.sub(r"[^\w.-]+", "-", name)


class Stopped(Exception):
    """SIGTERM (e.g. from timeout) during the rounds: the tables give the complete rounds."""


def raise_stopped(signum, frame):
    raise Stopped()


def alternated(items, i):
    """The order of round (or step) i: as given, reversed, as given, ... (A B C, C B A, ...)."""
    return items if i % 2 == 0 else items[::-1]
