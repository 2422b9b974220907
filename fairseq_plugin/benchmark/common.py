"""What the benchmark's parts share: the model sizes (PRESETS), the contestants' names, the
device a run is on (``Device``: fairseq's flags there, how its child processes are set up, how
their peak memory is read), fairseq-train's flags for both models, and the order of alternated
rounds."""

import os
import re
import sys

from . import cuda_peak

HERE = os.path.dirname(os.path.abspath(__file__))


PRESETS = {  # layers, d_model, d_ff, heads
    "default": (4, 256, 1024, 4),
    "tiny": (2, 64, 256, 4),
    "iwslt": (6, 512, 1024, 4),
    "base": (6, 512, 2048, 8),
    "multi30k": (3, 256, 512, 8),  # examples/multi30k's model
}


OURS, THEIRS, BEFORE = "annotated_transformer", "transformer", "annotated_transformer@before"
NO_PACKING = "annotated_transformer without packing"  # computing padding, as fairseq's does
OURS_TORCH_CHOICE = "annotated_transformer torch-choice"  # --fused-attention-backends torch
COMPILED = "annotated_transformer compiled"  # --compile-layers (--also-compiled)
THEIRS_NO_CUDNN = "transformer without cuDNN attention"  # --also-transformer-without-cudnn


def arch_of(contestant: str) -> str:
    """The --arch a contestant trains: fairseq's transformer, or annotated_transformer."""
    return THEIRS if contestant in (THEIRS, THEIRS_NO_CUDNN) else OURS


def model_flags(preset):
    layers, d, ff, heads = PRESETS[preset]
    return ["--encoder-layers", layers, "--decoder-layers", layers, "--encoder-embed-dim", d,
            "--decoder-embed-dim", d, "--encoder-ffn-embed-dim", ff, "--decoder-ffn-embed-dim",
            ff, "--encoder-attention-heads", heads, "--decoder-attention-heads", heads,
            "--share-all-embeddings", "--dropout", "0.1"]


def child_import(name: str, folder: str = HERE) -> str:
    """Python code that imports FOLDER/NAME.py (this folder's by default) in a child process by
    its path, as a module of its own: not through this package, whose ``fairseq_plugin`` would
    register the plugin before fairseq imports the --user-dir it was given (another checkout's,
    with --before)."""
    path = os.path.join(folder, f"{name}.py")
    return (f"spec = importlib.util.spec_from_file_location({name!r}, {path!r}); "
            f"{name} = importlib.util.module_from_spec(spec); spec.loader.exec_module({name}); ")


# Set-ups of the Python process that runs one of fairseq's CLIs, for both models alike:
# the GPU memory peak over the whole command (cuda_peak.py: fairseq's trainer resets torch's peak
# counter after every step), printed at exit; cuBLAS set up first (a matrix product: otherwise
# the first one inside the CLI's timed work pays for it)
CUDA_PEAK = child_import("cuda_peak") + "cuda_peak.switch_on(); "
# torch's cuDNN attention backend switched off
NO_CUDNN_ATTENTION = "torch.backends.cuda.enable_cudnn_sdp(False); "
# fairseq's CLIs in bf16 (fairseq_changes.BENCHMARK_BF16)
IN_BF16 = (child_import("fairseq_changes", os.path.dirname(HERE))
           + "fairseq_changes.install([c.name for c in fairseq_changes.BENCHMARK_BF16]); ")
BF16_MODELS = "fairseq_changes: the models in torch.bfloat16"  # what that prints


class Device:
    """Where fairseq runs: its flags, and how its peak memory is read (the process's resident
    memory on the CPU, torch.cuda's allocator on a GPU: CUDA_PEAK); on a GPU, whether torch may
    choose its cuDNN attention backend."""

    def __init__(self, kind: str = "cpu", precision: str = "fp32", cudnn_attention: bool = True):
        self.kind, self.precision, self.cudnn_attention = kind, precision, cudnn_attention

    def flags(self):
        return (["--cpu"] if self.kind == "cpu" else []) + (
            [] if self.precision == "fp32" else [f"--{self.precision}"])

    def command(self, cmd):
        """fairseq's command ``cmd`` as run here: on a GPU, or in bf16, in a Python that sets up
        the process first (CUDA_PEAK, NO_CUDNN_ATTENTION, IN_BF16)."""
        setup = ((CUDA_PEAK if self.kind == "cuda" else "")
                 + ("" if self.cudnn_attention else NO_CUDNN_ATTENTION)
                 + (IN_BF16 if self.precision == "bf16" else ""))
        if not setup:
            return cmd
        # -X faulthandler: an abort prints each Python thread's stack (run_measured shows it)
        return [sys.executable, "-X", "faulthandler", "-c", "import importlib.util, sys, torch; "
                f"sys.argv = sys.argv[1:]; {setup}" + child_import("cli_process")
                + "cli_process.run(sys.argv[0])", *cmd]

    def peak_mb(self, out: str, rss_mb: float) -> float:
        if self.kind == "cpu":
            return rss_mb
        return float(self.peak_line(out).split()[0])

    def peak_where(self, out: str) -> str:
        """On a GPU, when a training command's peak came and what was allocated between its steps
        (cuda_peak.PeakCounter.where): whether a gap is in the steps or in what stays."""
        return "" if self.kind == "cpu" else self.peak_line(out).split(None, 1)[1]

    @staticmethod
    def peak_line(out: str) -> str:
        """The end of cuda_peak's line at exit: 'MiB when...'."""
        return out.rsplit(cuda_peak.PRINTED + " ", 1)[1].splitlines()[0]


CPU = Device()


def fairseq_setup(flags):
    """(fairseq's configuration, its task) from fairseq-train's command-line ``flags``, set up in
    this process as fairseq-train sets them up (the --user-dir imported)."""
    from fairseq import options, tasks, utils
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    args = options.parse_args_and_arch(options.get_training_parser(), [str(f) for f in flags])
    cfg = convert_namespace_to_omegaconf(args)
    utils.import_user_module(cfg.common)
    return cfg, tasks.setup_task(cfg.task)


def without_cudnn(device: Device) -> Device:
    """The same device with torch's cuDNN attention backend off in fairseq's processes."""
    return Device(device.kind, device.precision, cudnn_attention=False)


def training_flags(data_bin, arch, preset, max_tokens, user_dir, device=CPU):
    """fairseq-train's arguments for both architectures (the same but for --arch)."""
    return [data_bin, "--user-dir", user_dir, "--arch", arch, *model_flags(preset),
            "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
            "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--lr", "5e-4",
            "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "100",
            "--max-tokens", max_tokens, "--seed", "1", *device.flags(), "--num-workers", "0"]


def folder_name(contestant: str) -> str:
    """A contestant's name as a folder name: annotated_transformer, annotated_transformer-before,
    annotated_transformer-torch-choice, annotated_transformer-without-packing, transformer."""
    return re.sub(r"[^\w.-]+", "-", contestant)


class Stopped(Exception):
    """SIGTERM (e.g. from timeout) during the rounds: the tables give the complete rounds."""


def raise_stopped(signum, frame):
    raise Stopped()


def alternated(contestants, i):
    """The order of round (or step) i: as given, reversed, as given, ... (A B C, C B A, ...)."""
    return contestants if i % 2 == 0 else contestants[::-1]
