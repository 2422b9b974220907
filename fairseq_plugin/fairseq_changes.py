"""Everything this plugin changes in fairseq (and in the Python process), in one place.

fairseq 0.12 runs as it is, except for the changes in ``CHANGES`` below. Each replaces one
attribute of a fairseq module (or of torch's or Python's) by a wrapper around the original, and
says in one line why, with the fairseq issue or version it works around. ``import fairseq_plugin``
installs the default ones (``install()``); a change to one of fairseq's commands (``fairseq_cli``)
is installed only while that command runs, i.e. when its module is already imported. The
benchmark's child processes ask for ``BENCHMARK_BF16`` too. ``removed(name)`` puts a change's
original back for a while: tests/test_fairseq_changes.py shows each change needed that way.

The wrappers themselves live with their subject (checkpoints.py, data_bin.py, errors.py,
interactive.py, launch.py, preemption.py, run_dir.py, signals.py; the benchmark's in
benchmark/bf16.py, which its child processes load by path), each named here by the function
itself: from a wrapper to its change, and back.
"""

import contextlib
import dataclasses
import importlib
import sys
from typing import Callable

from . import checkpoints, data_bin, errors, interactive, launch, preemption, run_dir, signals
from .benchmark import bf16


@dataclasses.dataclass(frozen=True)
class Change:
    """``module.attribute = wrapper(module.attribute)``. Without an attribute (torch's
    allowlist, which has no attribute to replace), ``wrapper()`` makes the change and returns
    the function that undoes it."""

    name: str
    module: str
    attribute: str  # may be dotted: "Trainer.save_checkpoint"
    wrapper: Callable
    why: str


CHANGES = (
    Change("restricted_unpickler_reads_fairseq_checkpoints", "torch.serialization", "",
           checkpoints.allow_fairseq_checkpoint_globals,
           "torch >= 2.6 loads with weights_only=True and refuses the argparse.Namespace of "
           "fairseq 0.12 checkpoints (fairseq #5610, #5603; fixed on fairseq's main only)"),
    Change("damaged_checkpoint_in_one_line", "fairseq.checkpoint_utils", "load_checkpoint_to_cpu",
           checkpoints.explain_unreadable_checkpoints,
           "fairseq 0.12 answers a truncated or damaged checkpoint with a zip reader's "
           "traceback; also allows the numpy arrays of --eval-bleu's saved counts"),
    Change("ranks_receive_the_loaded_checkpoint", "fairseq.distributed.utils",
           "_broadcast_object_slow", checkpoints.broadcast_reads_fairseq_state,
           "on torch >= 2.6 the other ranks refuse the DictConfig in the checkpoint state rank 0 "
           "loads and broadcasts: resuming with several ranks fails (fairseq 0.12, fairseq-fixed)"),
    Change("checkpoint_copies_whole", "fairseq.checkpoint_utils", "PathManager",
           checkpoints.whole_copies,
           "fairseq 0.12's save_checkpoint copies the first file to checkpoint_last.pt and "
           "checkpoint_best.pt in place: a kill during the copy tears them"),
    Change("saves_fail_whole_on_a_full_disk", "fairseq.checkpoint_utils", "save_checkpoint",
           checkpoints.saves_fail_whole,
           "fairseq 0.12 answers a disk that fills during a save with tracebacks, leaves the "
           "half-written CHECKPOINT.pt.tmp, and may have replaced checkpoint_best.pt already"),
    Change("one_try_on_a_full_disk", "fairseq.checkpoint_utils", "_torch_persistent_save",
           checkpoints.one_try_on_a_full_disk,
           "fairseq 0.12 retries torch.save three times into the same half-written file on a "
           "full disk, logging a traceback each time"),
    Change("resume_from_newest_whole_checkpoint", "fairseq.checkpoint_utils", "load_checkpoint",
           preemption.resume_from_newest_whole,
           "fairseq 0.12 stops on a damaged checkpoint_last.pt instead of resuming from the "
           "newest whole checkpoint, trains from scratch when an explicit --restore-file is "
           "missing, and forgets --patience's counter (fairseq #3531)"),
    Change("patience_saved_with_checkpoints", "fairseq.trainer", "Trainer.save_checkpoint",
           preemption.save_patience_too,
           "fairseq 0.12 keeps --patience's counter in a function attribute that no checkpoint "
           "holds (fairseq #3531)"),
    Change("save_and_exit_on_signal", "fairseq_cli.train", "validate_and_save",
           preemption.save_when_signalled,
           "fairseq 0.12 has no signal handler: SIGTERM or SIGUSR1 from a scheduler loses every "
           "update since the last save"),
    Change("launchers_environment_on_cpu", "fairseq.distributed.utils", "call_main",
           launch.world_from_launcher,
           "fairseq 0.12 on CPUs under torchrun or srun trains each rank alone (world size 1), "
           "divides by torch.cuda.device_count(), or asks for NCCL (fairseq #4302, #4164)"),
    Change("one_line_errors", "sys", "excepthook", errors.print_plugin_errors_as_one_line,
           "fairseq's commands answer a user's mistake (a missing file, a bad option) with a "
           "traceback"),
    Change("stop_signals_in_one_line", "signal", "", signals.stop_signals_in_one_line,
           "fairseq's commands end at Ctrl-C with a KeyboardInterrupt traceback and at SIGTERM "
           "without a word"),
    Change("unknown_options_in_one_line", "fairseq_cli.train", "add_defaults",
           errors.unknown_options_in_one_line,
           "fairseq 0.12 answers a misspelled model option or model name with an omegaconf "
           "ConfigKeyError or KeyError traceback"),
    Change("interactive_skips_bad_lines", "fairseq_cli.interactive", "make_batches",
           interactive.checked_make_batches,
           "fairseq-interactive 0.12 ends the session at an over-long line ('Size of sample #0 "
           "is invalid'), translates an empty one, and stdin's undecodable bytes as <unk>"),
    Change("one_run_per_save_dir", "fairseq.checkpoint_utils", "verify_checkpoint_directory",
           run_dir.locked_save_dir,
           "fairseq 0.12 has no lock on a --save-dir: a second fairseq-train into it runs to the "
           "end, the two runs overwriting each other's checkpoints"),
    Change("damaged_data_bin_in_one_line", "fairseq.data.indexed_dataset", "make_dataset",
           data_bin.checked_make_dataset,
           "fairseq 0.12 trusts a split's .idx: a .bin cut short stops training when a batch "
           "reaches it, with numpy's 'offset must be non-negative' and no file named"),
    Change("max_tokens_below_a_sentence_in_one_line", "fairseq.data.data_utils", "batch_by_size",
           errors.max_tokens_checked,
           "fairseq 0.12 answers --max-tokens below its longest sentence with an AssertionError "
           "traceback that names neither the sentence nor the fix"),
)


# for the benchmark's child processes only: fairseq 0.12's fairseq-train and fairseq-generate in
# bf16 (its trainer trains in bf16 under fairseq-hydra-train, which leaves --tpu off)
BENCHMARK_BF16 = (
    Change("bf16_without_tpu", "fairseq.options", "parse_args_and_arch", bf16.parse_without_tpu,
           "fairseq 0.12's --bf16 also switches on --tpu, and fairseq-train then looks for a "
           "TPU"),
    Change("generate_in_bf16", "fairseq.checkpoint_utils", "load_model_ensemble", bf16.load_in_bf16,
           "fairseq-generate 0.12 has no bf16 (only --fp16's model.half()): the models are "
           "turned to bf16 as they load, which it prints"),
)

_ALL = {change.name: change for change in CHANGES + BENCHMARK_BF16}
_INSTALLED = {}  # name -> (undo, redo)


def _owner_and_attribute(change: Change):
    owner = sys.modules[change.module]
    *path, attribute = change.attribute.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, attribute


def _make(change: Change):
    """Make the change; return (undo, redo)."""
    if not change.attribute:
        undo = change.wrapper()
        return undo, change.wrapper
    owner, attribute = _owner_and_attribute(change)
    before = getattr(owner, attribute)
    after = change.wrapper(before)
    setattr(owner, attribute, after)
    return (lambda: setattr(owner, attribute, before)), (lambda: setattr(owner, attribute, after))


def install(names=None) -> None:
    """Install the named changes (default: every one of CHANGES), each once; a change to a
    ``fairseq_cli`` command only if that command's module is imported."""
    for name in names or [change.name for change in CHANGES]:
        change = _ALL[name]
        if name in _INSTALLED:
            continue
        if change.module.startswith("fairseq_cli."):
            if change.module not in sys.modules:
                continue
        else:
            importlib.import_module(change.module)
        _INSTALLED[name] = _make(change)


def installed(name: str) -> bool:
    return name in _INSTALLED


@contextlib.contextmanager
def removed(name: str):
    """Inside, fairseq as it is without the change ``name`` (tests: each change is needed)."""
    undo, redo = _INSTALLED[name]
    undo()
    try:
        yield
    finally:
        redo()


def describe() -> str:
    """One line a change: what it replaces and why."""
    return "\n".join(f"{c.name}: {c.module}{'.' + c.attribute if c.attribute else ''}: {c.why}"
                     for c in CHANGES + BENCHMARK_BF16)
