"""Each of the plugin's changes to fairseq (fairseq_plugin/fairseq_changes.py) is needed: without
it (``fairseq_changes.removed``) fairseq misbehaves as the change's reason says, with it not.
NEEDED names the test that shows it for every change; those not here are in the files named."""

import argparse
import ast
import os
import re
import sys

import pytest
import torch
from omegaconf import OmegaConf

from conftest import make_dictionary
from fairseq_plugin import PluginError, checkpoints, fairseq_changes

HERE = os.path.dirname(os.path.abspath(__file__))

NEEDED = {
    "restricted_unpickler_reads_fairseq_checkpoints":
        "test_fairseq_changes.py::test_torch_loads_a_fairseq_namespace_only_with_the_allowlist",
    "damaged_checkpoint_in_one_line":
        "test_fairseq_changes.py::test_a_damaged_checkpoint_is_one_line_only_with_the_change",
    "ranks_receive_the_loaded_checkpoint":
        "test_fairseq_changes.py::test_other_ranks_unpickle_the_loaded_state_only_with_the_change",
    "checkpoint_copies_whole":
        "test_preemption.py::test_a_copy_killed_midway_leaves_the_old_checkpoint_whole",
    "saves_fail_whole_on_a_full_disk":
        "test_full_disk.py::test_a_save_that_fails_on_a_full_disk_puts_back_what_it_replaced",
    "one_try_on_a_full_disk":
        "test_full_disk.py::test_fairseq_tries_a_full_disk_three_times_only_without_the_change",
    "resume_from_newest_whole_checkpoint":
        "test_preemption.py::test_a_torn_checkpoint_last_is_passed_over_for_the_newest_whole_one",
    "patience_saved_with_checkpoints":
        "test_preemption.py::test_patience_counter_is_saved_and_restored",
    "save_and_exit_on_signal":
        "test_preemption.py::test_sigterm_at_a_random_moment_saves_and_the_same_command_resumes_there",
    "launchers_environment_on_cpu":
        "test_distributed.py::test_without_the_change_fairseq_trains_each_torchrun_rank_alone_on_cpus",
    "one_line_errors":
        "test_fairseq_changes.py::test_a_plugin_error_is_one_line_only_with_the_excepthook",
    "stop_signals_in_one_line":
        "test_fairseq_changes.py::test_a_stop_signal_ends_a_fairseq_command_in_one_line_only_with_the_change",
    "unknown_options_in_one_line":
        "test_fairseq_changes.py::test_an_unknown_model_name_is_refused_only_with_the_change",
    "interactive_skips_bad_lines":
        "test_fairseq_changes.py::test_interactive_skips_an_empty_line_only_with_the_change",
    "one_run_per_save_dir":
        "test_run_dir.py::test_fairseq_lets_two_trainings_into_one_save_dir_only_without_the_change",
    "damaged_data_bin_in_one_line":
        "test_data_bin.py::test_fairseq_loads_a_bin_cut_short_without_a_word_only_without_the_change",
    "max_tokens_below_a_sentence_in_one_line":
        "test_fairseq_changes.py::test_max_tokens_below_a_sentence_is_one_line_only_with_the_change",
    "bf16_without_tpu": "test_benchmark.py::"
        "test_stopped_by_sigterm_the_benchmark_reports_its_complete_rounds_with_the_other_models",
    "generate_in_bf16": "test_benchmark.py::"
        "test_stopped_by_sigterm_the_benchmark_reports_its_complete_rounds_with_the_other_models",
}


def test_every_change_has_a_reason_and_a_test_that_exists():
    changes = fairseq_changes.CHANGES + fairseq_changes.BENCHMARK_BF16
    assert sorted(NEEDED) == sorted(c.name for c in changes)
    for change in changes:
        assert change.why and "\n" not in change.why
        path, name = NEEDED[change.name].split("::")
        tree = ast.parse(open(os.path.join(HERE, path)).read())
        assert name in {f.name for f in tree.body if isinstance(f, ast.FunctionDef)}, name
    assert len(fairseq_changes.describe().splitlines()) == len(changes)


def test_every_change_names_its_wrapper_and_every_wrapper_names_its_change():
    """From a change to its wrapper by object, and back: the wrapper's docstring names
    fairseq_changes.py (a rename is an import error, not a failure at run time)."""
    for change in fairseq_changes.CHANGES + fairseq_changes.BENCHMARK_BF16:
        assert callable(change.wrapper), change.name
        assert change.wrapper.__module__.startswith("fairseq_plugin."), change.name
        assert "fairseq_changes.py" in (change.wrapper.__doc__ or ""), change.wrapper.__name__


@pytest.mark.skipif(not checkpoints.HAS_ALLOWLIST,
                    reason="torch < 2.4 loads without weights_only by default: nothing to allow")
def test_torch_loads_a_fairseq_namespace_only_with_the_allowlist(tmp_path):
    path = tmp_path / "namespace.pt"
    torch.save({"args": argparse.Namespace(arch="transformer")}, path)
    with fairseq_changes.removed("restricted_unpickler_reads_fairseq_checkpoints"):
        with pytest.raises(Exception, match="Unsupported global"):
            torch.load(path, weights_only=True)
    assert torch.load(path, weights_only=True)["args"].arch == "transformer"


def test_a_damaged_checkpoint_is_one_line_only_with_the_change(tmp_path):
    from fairseq import checkpoint_utils

    path = tmp_path / "checkpoint_last.pt"
    torch.save({"model": {"w": torch.zeros(1000)}}, path)
    path.write_bytes(path.read_bytes()[:300])  # truncated
    with fairseq_changes.removed("damaged_checkpoint_in_one_line"):
        with pytest.raises(Exception) as fairseqs:
            checkpoint_utils.load_checkpoint_to_cpu(str(path))
    assert not isinstance(fairseqs.value, PluginError)
    with pytest.raises(PluginError, match="the file is damaged or incomplete"):
        checkpoint_utils.load_checkpoint_to_cpu(str(path))


def test_a_checkpoint_with_changed_bytes_is_found_at_load_and_the_newest_whole_one_named(
        tmp_path):
    """torch itself reads a changed tensor byte without a word; the zip's CRC-32 finds it."""
    from fairseq import checkpoint_utils

    older, path = tmp_path / "checkpoint1.pt", tmp_path / "checkpoint_last.pt"
    for p in (older, path):
        torch.save({"model": {"w": torch.zeros(1000)}}, p)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    assert torch.load(path)["model"]["w"].abs().sum() > 0  # loads, silently changed
    with pytest.raises(PluginError) as error:
        checkpoint_utils.load_checkpoint_to_cpu(str(path))
    assert str(error.value) == (f"cannot read checkpoint {path} (a record fails its CRC-32 "
                                f"check): the file is damaged or incomplete; use another one: "
                                f"the newest whole checkpoint beside it is {older}")


def test_a_plugin_error_is_one_line_only_with_the_excepthook(capsys):
    error = PluginError("what is wrong; how to fix it")
    with fairseq_changes.removed("one_line_errors"):
        sys.excepthook(PluginError, error, None)
    assert "fairseq_plugin: error:" not in capsys.readouterr().err
    sys.excepthook(PluginError, error, None)
    assert capsys.readouterr().err == "fairseq_plugin: error: what is wrong; how to fix it\n"


def test_an_unknown_model_name_is_refused_only_with_the_change():
    from fairseq_cli import train

    fairseq_changes.install()  # (fairseq_cli.train is imported now)
    with fairseq_changes.removed("unknown_options_in_one_line"):
        train.add_defaults(OmegaConf.create({"model": {"_name": "annotated_transformr"}}))
    with pytest.raises(PluginError, match="unknown model model._name=annotated_transformr"):
        train.add_defaults(OmegaConf.create({"model": {"_name": "annotated_transformr"}}))


def test_interactive_skips_an_empty_line_only_with_the_change(tmp_path, capsys):
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq_cli import interactive

    fairseq_changes.install()  # (fairseq_cli.interactive is imported now)
    for lang in ("src", "tgt"):
        make_dictionary().save(str(tmp_path / f"dict.{lang}.txt"))
    args = options.parse_args_and_arch(options.get_interactive_generation_parser(),
                                       [str(tmp_path), "--source-lang", "src", "--target-lang",
                                        "tgt", "--cpu"])
    cfg = convert_namespace_to_omegaconf(args)
    task = tasks.setup_task(cfg.task)

    def ids():
        batches = interactive.make_batches(["w1 w2", "", "w3"], cfg, task, (1024, 1024),
                                           lambda line: line)
        return sorted(i for batch in batches for i in batch.ids.tolist())

    with fairseq_changes.removed("interactive_skips_bad_lines"):
        assert ids() == [0, 1, 2]  # the empty line "translated"
    assert ids() == [0, 2]
    assert "skipped an empty input line" in capsys.readouterr().err
    # stdin's undecodable bytes (surrogates, PEP 383): refused, not translated as <unk>
    latin1 = "d \xfc e".encode("latin-1").decode("utf-8", "surrogateescape")
    with fairseq_changes.removed("interactive_skips_bad_lines"):
        assert len(list(interactive.make_batches([latin1], cfg, task, (1024, 1024),
                                                 lambda line: line))) == 1
    with pytest.raises(PluginError, match=r"^the input is not UTF-8 text \(byte 0xfc in "):
        list(interactive.make_batches(["w1", latin1], cfg, task, (1024, 1024), lambda line: line))


@pytest.mark.skipif(not checkpoints.HAS_SCOPED_ALLOWLIST,
                    reason="torch < 2.5 loads without weights_only by default")
def test_other_ranks_unpickle_the_loaded_state_only_with_the_change(monkeypatch):
    """What a rank other than 0 does with the state rank 0 loaded and broadcast (fairseq's
    load_checkpoint_to_cpu makes its cfg a DictConfig), the broadcast itself stubbed."""
    import io

    from fairseq.distributed import utils as distributed_utils

    state = {"cfg": OmegaConf.create({"model": {"_name": "annotated_transformer", "n": [1, 2]}}),
             "model": {"w": torch.zeros(3)}}
    buffer = io.BytesIO()
    torch.save(state, buffer)

    def broadcast(tensor, src, group):  # what rank 0 sends: the length, then the bytes
        data = buffer.getvalue()
        tensor.copy_(torch.tensor([len(data)]) if tensor.numel() == 1 and tensor.dtype ==
                     torch.int64 else torch.frombuffer(bytearray(data), dtype=torch.uint8))

    monkeypatch.setattr(distributed_utils, "broadcast", broadcast)
    monkeypatch.setattr(distributed_utils, "get_rank", lambda group: 1)
    receive = lambda: distributed_utils._broadcast_object_slow(None, 0, None,  # noqa: E731
                                                               torch.device("cpu"))
    with fairseq_changes.removed("ranks_receive_the_loaded_checkpoint"):
        with pytest.raises(Exception, match="Unsupported global"):
            receive()
    received = receive()
    assert received["cfg"].model.n == [1, 2] and torch.equal(received["model"]["w"],
                                                              torch.zeros(3))
    # and the process-wide allowlist is as it was (a scoped one took the Namespace with it)
    assert argparse.Namespace in torch.serialization.get_safe_globals()


def test_max_tokens_below_a_sentence_is_one_line_only_with_the_change():
    """fairseq's batching asserts; with the change, one line names the sentence and the size to
    raise --max-tokens to. Sizes within --max-tokens batch as before."""
    import numpy as np
    from fairseq.data import data_utils

    fairseq_changes.install()
    indices = np.array([4, 7, 9], dtype=np.int64)
    sizes = np.array([3, 12, 5], dtype=np.int64)  # sentence 7: 12 tokens

    def batches(max_tokens):
        return [b.tolist() for b in data_utils.batch_by_size(
            indices, lambda i: 0, num_tokens_vec=sizes, max_tokens=max_tokens)]

    with fairseq_changes.removed("max_tokens_below_a_sentence_in_one_line"):
        with pytest.raises(AssertionError):
            batches(10)
    with pytest.raises(PluginError, match=r"^--max-tokens 10 is less than the 12 tokens of "
                       r"sentence 7 of the split .*raise --max-tokens to at least 12"):
        batches(10)
    assert sum(batches(12), []) == [4, 7, 9]


STOPPABLE = """
import sys, time
sys.argv[0] = "fairseq-stand-in"  # one of fairseq's commands, for the plugin
from fairseq_plugin import fairseq_changes
if "{removed}":  # undone for good (removed() would put it back as the exception leaves)
    fairseq_changes._INSTALLED["{removed}"][0]()
print("ready", flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("signum", [2, 15])  # SIGINT (Ctrl-C), SIGTERM
def test_a_stop_signal_ends_a_fairseq_command_in_one_line_only_with_the_change(signum, tmp_path):
    """Ctrl-C or SIGTERM in one of fairseq's commands (before training's own save on a signal
    takes over): one line, and the process ends by the signal. Without the change: Ctrl-C's
    traceback, SIGTERM's silence."""
    import signal
    import subprocess

    results = {}
    for name in ("", "stop_signals_in_one_line" if signum == 15 else "one_line_errors"):
        script = tmp_path / "stand_in.py"
        script.write_text(STOPPABLE.format(removed=name))
        proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=60)
        # (fairseq's import logs an INFO line about tensorboardX, in either version's format)
        results[name] = (proc.returncode, "".join(line for line in err.splitlines(True)
                                                  if not re.search(r"(^|\| )INFO[:| ]", line)))
    name = signal.Signals(signum).name
    assert results[""] == (-signum, "fairseq_plugin: fairseq-stand-in stopped by "
                                    f"{'Ctrl-C (SIGINT)' if signum == 2 else name}\n")
    without = [err for name, (_, err) in results.items() if name][0]
    assert ("Traceback" in without) if signum == 2 else without == ""
