"""One line for user errors, the full traceback on request, and no wrong diagnosis."""

import fractions
import os
import subprocess
import sys
from argparse import Namespace

import pytest
import torch
from fairseq import checkpoint_utils

from fairseq_plugin.errors import TRACEBACK_VARIABLE, PluginError, one_line_error, spelling_hint
from fairseq_plugin.torch_release import TORCH_RELEASE, release
from conftest import build_tiny_model, exit_code, make_dictionary

RAISE = ("import fairseq_plugin\n"
         "def load():\n"
         "    raise fairseq_plugin.PluginError('the checkpoint is wrong; use another')\n"
         "{body}\n")


def run_python(body, **env):
    code = RAISE.format(body=body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, **env}, cwd=os.path.dirname(os.path.dirname(
                              os.path.abspath(__file__))))


def raised(f):
    try:
        f()
    except BaseException as e:  # noqa: B902
        return e
    raise AssertionError("nothing raised")


def test_a_plugin_error_is_one_line_and_the_traceback_is_there_on_request():
    proc = run_python("load()")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1:] == [
        "fairseq_plugin: error: the checkpoint is wrong; use another"]
    assert "Traceback" not in proc.stderr
    proc = run_python("load()", **{TRACEBACK_VARIABLE: "1"})
    assert proc.returncode == 1
    assert "Traceback (most recent call last)" in proc.stderr and "in load" in proc.stderr


@pytest.mark.main_lane  # the plugin's own commands' error handling, whatever fairseq's version
@pytest.mark.parametrize("command", ["annotated-prepare", "annotated-average-checkpoints",
                                     "annotated-export-fairseq", "annotated-evaluate-bleu",
                                     "annotated-attention-heatmaps"])
def test_the_plugins_own_commands_show_the_traceback_on_request(command, tmp_path, monkeypatch):
    """Each console script's main (run here: a process turns what it raises into the printed
    traceback, test_a_plugin_error_is_one_line_and_the_traceback_is_there_on_request) exits
    with one line, and with FAIRSEQ_PLUGIN_TRACEBACK=1 raises the error itself."""
    from importlib.metadata import entry_points

    from fairseq_plugin.cli.streaming import PrepareError

    (script,) = [e for e in entry_points(group="console_scripts") if e.name == command]
    main = script.load()
    args = {"annotated-prepare": ["-s", "de", "-t", "en", "--raw-dir", tmp_path, "--dest",
                                  tmp_path / "bin"],
            "annotated-average-checkpoints": ["--inputs", tmp_path / "a.pt", "--output",
                                              tmp_path / "avg.pt"],
            "annotated-export-fairseq": [tmp_path / "a.pt", "--output", tmp_path / "out.pt"],
            "annotated-evaluate-bleu": [tmp_path, tmp_path / "a.pt"],
            "annotated-attention-heatmaps": [tmp_path, tmp_path / "a.pt", "Hallo"]}[command]
    args = [str(a) for a in args]
    monkeypatch.delenv(TRACEBACK_VARIABLE, raising=False)
    stopped = exit_code(main, args)
    line = str(stopped)
    assert line.startswith(f"{command}: error: ") and "\n" not in line, line
    monkeypatch.setenv(TRACEBACK_VARIABLE, "1")
    with pytest.raises(PrepareError if command == "annotated-prepare" else PluginError):
        main(args)


def test_a_program_of_the_users_keeps_the_traceback_of_a_missing_file():
    """Only fairseq's commands shorten a missing path to one line (tests/test_cli.py); a program
    of the user's that imports the plugin keeps its traceback."""
    proc = run_python("open('/no/such/file.txt')")
    assert "Traceback (most recent call last)" in proc.stderr
    assert "FileNotFoundError" in proc.stderr


def test_an_unrelated_error_while_a_plugin_error_unwinds_keeps_its_traceback():
    proc = run_python("try:\n    load()\nexcept fairseq_plugin.PluginError:\n    {}['missing']")
    assert "Traceback (most recent call last)" in proc.stderr
    assert "KeyError: 'missing'" in proc.stderr


def test_plugin_errors_re_raised_by_fairseq_stay_one_line():
    def restore():  # what fairseq's trainer does with a failed --restore-file
        try:
            raise PluginError("the checkpoint does not hold this model's parameters")
        except Exception:
            raise Exception("Cannot load model parameters from checkpoint x.pt; please ensure "
                            "that the architectures match.")

    def wrapped():
        try:
            raise PluginError("bad input")
        except PluginError as e:
            raise RuntimeError("while loading") from e

    def unrelated():
        try:
            raise PluginError("bad input")
        except PluginError:
            raise RuntimeError("a bug in the handler")

    assert one_line_error(raised(restore)) == "the checkpoint does not hold this model's parameters"
    assert one_line_error(raised(wrapped)) == "bad input"
    assert one_line_error(raised(unrelated)) is None


@pytest.mark.parametrize("zip_format", [True, False])
def test_a_checkpoint_torch_reads_but_fairseq_cannot_use_is_not_called_damaged(tmp_path,
                                                                               zip_format):
    path = tmp_path / "checkpoint.pt"
    torch.save({"model": {}}, path, _use_new_zipfile_serialization=zip_format)
    error = raised(lambda: checkpoint_utils.load_checkpoint_to_cpu(str(path)))
    assert isinstance(error, KeyError) and not isinstance(error, PluginError)  # fairseq's own


@pytest.mark.skipif(TORCH_RELEASE < (2, 6), reason="torch < 2.6 loads checkpoints without "
                                                     "weights_only by default: nothing refuses")
@pytest.mark.parametrize("zip_format", [True, False])
def test_a_checkpoint_refused_by_weights_only_is_not_called_damaged(tmp_path, zip_format):
    path = tmp_path / "checkpoint.pt"
    torch.save({"model": {}, "extra": fractions.Fraction(1, 3)}, path,
               _use_new_zipfile_serialization=zip_format)
    error = raised(lambda: checkpoint_utils.load_checkpoint_to_cpu(str(path)))
    assert not isinstance(error, PluginError)
    assert "Weights only load failed" in str(error) and "damaged" not in str(error)


def test_a_misspelled_name_gets_the_closest_known_one_else_where_the_names_are_listed():
    known = ["encoder_layers", "decoder_layers", "dropout"]
    assert spelling_hint("encoder_layer", known) == "did you mean encoder_layers?"
    assert spelling_hint("xyz", known, "docs/reference.md") == (
        "check its spelling (docs/reference.md lists the options)")
    assert spelling_hint("xyz", known) == "check its spelling"


def test_the_wheelhouse_script_refuses_to_mix_new_wheels_with_earlier_ones(tmp_path, capsys):
    """Two versions of one package in the wheelhouse would make pip refuse them all on the node."""
    import runpy

    from conftest import REPO

    earlier = tmp_path / "sacrebleu-2.0.0-py3-none-any.whl"
    earlier.write_text("an earlier build")
    main = runpy.run_path(os.path.join(REPO, "scripts", "make_wheelhouse.py"))["main"]
    exit_code(main, [str(tmp_path)])
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        f"error: {tmp_path} already holds 1 wheels; pass --force to replace them, or give a new "
        f"DEST")
    assert earlier.read_text() == "an earlier build"


@pytest.mark.parametrize("version, expected", [
    ("2.13.0+cpu", (2, 13)), ("2.1.2", (2, 1)), ("2.6.0a0+ecf3bae40a", (2, 6))])
def test_a_torch_pre_release_counts_as_the_release_it_implements(version, expected):
    """NVIDIA's containers ship torch "2.6.0a0+..." builds, which have torch 2.6's features."""
    assert release(version) == expected


def data_bin_with_raw_text(tmp_path):
    """A data-bin's files, as annotated-prepare leaves them: dictionaries, BPE codes, raw text."""
    db = tmp_path / "data-bin"
    (db / "raw").mkdir(parents=True)
    files = {db / "dict.en.txt": "a 1\n", db / "bpe.codes": "a b\n", db / "raw" / "test.en": "x\n"}
    for path, text in files.items():
        path.write_text(text)
    (tmp_path / "checkpoint.pt").write_bytes(b"not read: the output is refused first")
    (tmp_path / "link-to-data-bin").symlink_to(db)
    return db, files


@pytest.mark.main_lane  # the plugin's own commands' output checks, whatever fairseq's version
@pytest.mark.parametrize("target", ["raw/test.en", "dict.en.txt", "bpe.codes", "new.txt", ".",
                                    "LINK/raw/test.en"])
def test_no_command_writes_its_output_inside_the_data_bin_it_reads(target, tmp_path):
    """annotated-evaluate-bleu --output, annotated-export-fairseq --output (and --ctranslate2)
    with --data, annotated-attention-heatmaps --out-dir: a path inside the data-bin the command
    reads (an existing file of it or a new one, through a link too) is refused in one line,
    --force or not, and every file of the data-bin stays as it was. (Each command's main runs in
    this process: its console script only calls it, and a script's refusal as a process is
    test_translation_pipeline's and test_export's.)"""
    from fairseq_plugin import export
    from fairseq_plugin.cli import evaluate, heatmaps

    db, files = data_bin_with_raw_text(tmp_path)
    path = (str(tmp_path / "link-to-data-bin" / target[5:]) if target.startswith("LINK/")
            else str(db / target))
    checkpoint = str(tmp_path / "checkpoint.pt")
    given = path if target != "." else str(db)
    runs = {
        "annotated-evaluate-bleu": (evaluate.main, [str(db), checkpoint, "--output", given],
                                    "--output"),
        "annotated-export-fairseq": (export.main, [checkpoint, "--output", given, "--data",
                                                   str(db), "--force"], "--output"),
        "annotated-attention-heatmaps": (heatmaps.main, [str(db), checkpoint, "Ein Hund.",
                                                         "--out-dir", given], "--out-dir"),
    }
    if target == "new.txt":
        runs["annotated-export-fairseq --ctranslate2"] = (
            export.main, [checkpoint, "--output", str(tmp_path / "t.pt"), "--data", str(db),
                          "--ctranslate2", given, "--force"], "--ctranslate2")
    for command, (main, args, option) in runs.items():
        refused = exit_code(main, args)
        assert str(refused) == (
            f"{command.split()[0]}: error: {option} {given} is inside {db}, which this command "
            "reads; give a path outside it (its files are kept)")
        assert {path: path.read_text() for path in files} == {
            path: text for path, text in zip(files, ("a 1\n", "a b\n", "x\n"))}
        assert sorted(os.listdir(db)) == ["bpe.codes", "dict.en.txt", "raw"]


def test_averaging_refuses_checkpoints_of_other_dictionaries(tmp_path):
    """Two checkpoints of one architecture and size but other words in their dictionaries are
    not the same model: averaging them is refused in one line (their fingerprints differ)."""
    from fairseq_plugin.cli import average_checkpoints

    other = make_dictionary()
    other.symbols[5], other.symbols[6] = other.symbols[6], other.symbols[5]
    paths = []
    for name, d in (("a", make_dictionary()), ("b", make_dictionary()), ("c", other)):
        paths.append(str(tmp_path / f"{name}.pt"))
        torch.save({"model": build_tiny_model(d).state_dict(),
                    "cfg": {"model": {"_name": "annotated_transformer_tiny"}}}, paths[-1])
    averaged = average_checkpoints.average(paths[:2])["model"]
    assert averaged["dictionary_fingerprint"].tolist()[::2] == [34, 34]
    with pytest.raises(PluginError, match=r"^cannot average .*a\.pt and .*c\.pt: their "
                                          r"dictionary_fingerprint differ"):
        average_checkpoints.average([paths[0], paths[2]])


# checkpoints of another architecture or other dictionaries (the model's load_state_dict)

def test_another_architectures_checkpoint_is_named_as_such_before_any_layer_norm_advice():
    """fairseq's pre-LN transformer (its final LayerNorm is encoder.layer_norm, ours
    encoder.norm) loaded into this model: "another architecture", strict or not, not the
    --model-overrides advice for a one-flag pre-LN checkpoint."""
    from fairseq_plugin.export import transformer_args, transformer_state_dict

    ours = build_tiny_model()
    args = transformer_args(ours.options(Namespace(_name="annotated_transformer_tiny")))
    d = ours.encoder.dictionary
    theirs = transformer_state_dict(ours.state_dict(), args, d.pad(), d.pad())
    for strict in (True, False):
        with pytest.raises(PluginError, match=r"^the checkpoint holds another architecture's "
                           r"parameters \(e\.g\. encoder\.\S+\), not an annotated_transformer's"):
            build_tiny_model().load_state_dict(theirs, strict=strict)


def test_a_checkpoint_of_other_dictionaries_of_the_same_size_is_refused_in_one_line():
    """The model keeps a fingerprint of the dictionaries it was built with (each one's size and a
    hash of its words), so its checkpoints do; loaded into a model of dictionaries of the same
    size but other words, it is refused in one line, unless accept_other_dictionaries; another
    size gets the size's own message; a state without a fingerprint (from before it) loads."""
    ours = build_tiny_model().state_dict()
    assert ours["dictionary_fingerprint"].tolist()[::2] == [34, 34]
    build_tiny_model().load_state_dict(ours)  # the same words
    other = make_dictionary()
    other.symbols[5], other.symbols[6] = other.symbols[6], other.symbols[5]  # two words swapped
    with pytest.raises(PluginError, match=r"^the checkpoint was trained with other dictionaries "
                       r"of the same size: .*--model-overrides "
                       r"\"\{'accept_other_dictionaries': True\}\"$"):
        build_tiny_model(other).load_state_dict(ours)
    build_tiny_model(other, accept_other_dictionaries=True).load_state_dict(ours)
    with pytest.raises(PluginError, match=r"^the checkpoint was trained with a dictionary of 34 "
                       r"types but this data's dictionary has 35"):
        build_tiny_model(make_dictionary(31)).load_state_dict(ours)
    before = {k: v for k, v in ours.items() if k != "dictionary_fingerprint"}
    model = build_tiny_model(other)
    model.load_state_dict(before)
    assert torch.equal(model.dictionary_fingerprint, build_tiny_model(other).dictionary_fingerprint)
