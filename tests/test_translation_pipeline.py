"""Real text: preparation (sacremoses + subword-nmt + fairseq-preprocess), training, detokenised
sacreBLEU, checkpoint averaging — on a small slice of the bundled Tatoeba sample."""

import gzip
import json
import math
import inspect
import os
import re
import runpy
import subprocess
import sys

import pytest
import torch

from conftest import BUNDLED, REPO, assert_one_line_error, cli, exit_code, write_slice
from fairseq_plugin.cli import average_checkpoints, heatmaps
from fairseq_plugin.cli import evaluate as evaluate_bleu
from fairseq_plugin.cli import corpora, streaming
from fairseq_plugin.cli import prepare as prepare_translation
from fairseq_plugin.cli.prepare import Preparation
from fairseq_plugin.errors import PluginError

def read_lines(path):
    with open(path, encoding="utf-8") as f:
        return f.read().splitlines()


def test_prepare_shows_each_step_of_its_work_in_a_log(prepared):
    w, _ = prepared
    lines = (w / "prepare.stderr").read_text().splitlines()
    splits = (("train", 3000), ("valid", 60), ("test", 60))
    for step in [f"tokenise {split}: {n:,} pairs in " for split, n in splits] + [
            f"apply BPE {split}.{lang}: {n:,} lines in " for split, n in splits
            for lang in ("de", "en")] + ["learn joint BPE on train.de + train.en: 500 merges in "]:
        assert any(line.startswith(step) for line in lines), step
    assert b"\r" not in (w / "prepare.stderr").read_bytes()  # no bar drawn into the log
    binarised = [line for line in lines if line.startswith("  fairseq-preprocess [")]
    assert len(binarised) == 6 and "train.de: 3000 sents" in binarised[0]


def test_prepare_writes_bpe_text_joined_dictionaries_and_references(prepared):
    w, settings = prepared
    b = w / "bin"
    assert settings["splits"] == {"train": 3000, "valid": 60, "test": 60}
    for name in ("bpe.codes", "dict.de.txt", "dict.en.txt", "prepare.json", "raw/test.en",
                 "train.de-en.de.bin", "train.de-en.en.idx", "test.de-en.de.bin"):
        assert (b / name).exists(), name
    assert (b / "dict.de.txt").read_text() == (b / "dict.en.txt").read_text()  # joined
    codes = (b / "bpe.codes").read_text().splitlines()
    assert codes[0].startswith("#version") and len(codes) == 501
    train_de = (b / "text" / "train.de").read_text()
    assert "@@ " in train_de  # BPE applied
    # Moses tokenisation: punctuation split off; raw references kept, but not a byte-order mark
    references = read_lines(b / "raw" / "test.en")
    assert read_lines(w / "raw" / "test.en")[0] == "\ufeff" + references[0]
    assert references[1:] == read_lines(w / "raw" / "test.en")[1:]
    assert (b / "text" / "test.en").read_text().splitlines()[0].endswith(" .")
    assert "\ufeff" not in (b / "text" / "train.de").read_text()


def test_prepare_tokenises_as_fairseq_interactive_tokenizer_moses_does(prepared):
    """The training text, BPE undone, is what fairseq-interactive --tokenizer moses makes of the
    raw text: typographic quotes and apostrophes (in 16 lines of this slice) included."""
    from argparse import Namespace

    from fairseq.data import encoders

    w, _ = prepared
    for lang in ("de", "en"):
        interactive = encoders.build_tokenizer(Namespace(tokenizer="moses", source_lang=lang,
                                                         target_lang="en", moses_no_dash_splits=False,
                                                         moses_no_escape=False))
        raw = [line.lstrip("\ufeff") for line in read_lines(w / "raw" / f"train.{lang}")]
        trained_on = [line.replace("@@ ", "") for line in read_lines(w / "bin" / "text" / f"train.{lang}")]
        assert trained_on == [interactive.encode(line) for line in raw]
    assert sum("„" in line or "’" in line for line in read_lines(w / "raw" / "train.de")) >= 10


def test_prepare_refuses_misaligned_files(tmp_path):
    write_slice(tmp_path / "raw", n_train=50, n_eval=5)
    with open(tmp_path / "raw" / "valid.en", "a") as f:
        f.write("One line too many.\n")
    proc = cli("annotated-prepare", "-s", "de", "-t", "en", "--raw-dir", tmp_path / "raw",
               "--dest", tmp_path / "bin", check=False)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == (
        f"annotated-prepare: error: {tmp_path}/raw/valid.de has 5 lines but "
        f"{tmp_path}/raw/valid.en has 6: parallel files must be aligned line by line")


def test_prepare_of_the_bundled_corpus_outside_the_repository_says_where_to_run_it(tmp_path):
    proc = cli("annotated-prepare", "--corpus", "tatoeba", "--dest", "bin", cwd=tmp_path,
               check=False)
    assert_one_line_error(proc, "annotated-prepare: error: --corpus tatoeba reads "
                                "examples/tatoeba/data of this repository, which is not here: run "
                                "annotated-prepare in the repository's root, or pass --raw-dir "
                                "PATH/examples/tatoeba/data")
    assert os.listdir(tmp_path) == []


def test_a_named_corpus_is_downloaded_gunzipped_and_prepared_under_its_split_names(
        tmp_path, monkeypatch):
    """--corpus multi30k without --raw-dir: its six .gz files are fetched (here from file:// URLs
    standing in for the web) into DEST.raw, gunzipped, and its test2016 files are the test set;
    a file that cannot be fetched is one line naming it and the offline way (--raw-dir)."""
    web = tmp_path / "web"
    write_slice(web, n_train=200, n_eval=20)
    urls = {}
    for split, published in (("train", "train"), ("valid", "valid"), ("test2016", "test")):
        for lang in ("de", "en"):
            gz = web / f"{published}.{lang}.gz"
            gz.write_bytes(gzip.compress((web / f"{published}.{lang}").read_bytes()))
            urls[f"{split}.{lang}"] = gz.as_uri()
    offline = {**urls, "train.de": (web / "gone.de.gz").as_uri()}
    monkeypatch.setitem(corpora.CORPORA["multi30k"], "download", offline)
    refused = exit_code(prepare_translation.main,
                        ["--corpus", "multi30k", "--dest", str(tmp_path / "bin")])
    last = str(refused)
    assert "\n" not in last
    assert last.startswith(f"annotated-prepare: error: cannot download {offline['train.de']} (")
    assert last.endswith("on a machine without internet access, pass the raw files with --raw-dir")
    monkeypatch.setitem(corpora.CORPORA["multi30k"], "download", urls)
    prepare_translation.main(["--corpus", "multi30k", "--dest", str(tmp_path / "bin") + "/",
                              "--bpe-merges", "100"])  # DEST/: its raw text still in DEST.raw
    for lang in ("de", "en"):
        assert (tmp_path / "bin.raw" / f"test2016.{lang}").read_text(encoding="utf-8") == \
            (web / f"test.{lang}").read_text(encoding="utf-8")
    settings = json.loads((tmp_path / "bin" / "prepare.json").read_text())
    assert settings["splits"] == {"train": 200, "valid": 20, "test": 20}
    assert os.path.exists(tmp_path / "bin" / "test.de-en.de.bin")


@pytest.mark.parametrize("env, message", [
    ({"DEVICE": "gpu", "PRECISION": "bf16"}, "run.sh: error: PRECISION=bf16: fairseq 0.12's "
     "--bf16 also switches on --tpu (fairseq-train then looks for a TPU); use PRECISION=fp16, "
     "amp or fp32"),
    ({"DEVICE": "gpu", "PRECISION": "fp8"}, "run.sh: error: PRECISION=fp8; use PRECISION=fp16, "
     "amp or fp32"),
    ({"DEVICE": "tpu"}, "run.sh: error: DEVICE=tpu; use DEVICE=cpu or DEVICE=gpu"),
    ({"EPOCHS": "0"}, "run.sh: error: EPOCHS=0; give a number of epochs >= 1"),
    ({"SEED": "one"}, "run.sh: error: SEED=one; give a whole number (fairseq's --seed)"),
])
def test_the_multi30k_recipe_refuses_bad_settings_before_it_starts(tmp_path, env, message):
    run = os.path.join(REPO, "examples", "multi30k", "run.sh")
    proc = subprocess.run(["bash", run], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "WORK": str(tmp_path / "work"), **env})
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [message]
    assert not (tmp_path / "work").exists()


def test_prepare_reads_gzipped_text_as_the_plain_text(tmp_path):
    """RAW/train.de.gz serves for RAW/train.de (the bundled sample is gzipped)."""
    write_slice(tmp_path / "plain", n_train=20, n_eval=5, byte_order_mark=("train.de",))
    (tmp_path / "gz").mkdir()
    for lang in ("de", "en"):
        with open(tmp_path / "plain" / f"train.{lang}", "rb") as f, \
                gzip.open(tmp_path / "gz" / f"train.{lang}.gz", "wb") as out:
            out.write(f.read())
    plain = prepare_translation.read_parallel(str(tmp_path / "plain"), "train", "de", "en")
    zipped = prepare_translation.read_parallel(str(tmp_path / "gz"), "train", "de", "en")
    assert zipped == plain and len(plain[0]) == 20
    assert not plain[0][0].startswith("\ufeff")  # the byte order mark is not text


def test_prepare_refuses_missing_and_empty_input_and_a_non_empty_destination(tmp_path):
    splits = {"train": "train", "valid": "valid", "test": "test"}
    write_slice(tmp_path / "raw", n_train=50, n_eval=5)
    os.remove(tmp_path / "raw" / "test.en")
    with pytest.raises(prepare_translation.PrepareError, match="missing file .*test.en"):
        prepare_translation.prepare(Preparation(
            str(tmp_path / "raw"), str(tmp_path / "a"), "de", "en", splits))
    assert not (tmp_path / "a").exists()  # refused before anything is written
    for lang in ("de", "en"):
        open(tmp_path / "raw" / f"test.{lang}", "w").close()
    with pytest.raises(prepare_translation.PrepareError, match="are empty"):
        prepare_translation.prepare(Preparation(
            str(tmp_path / "raw"), str(tmp_path / "b"), "de", "en", splits))
    assert not (tmp_path / "b").exists()
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "keep.txt").write_text("mine")
    for force in (False, True):  # a folder of other files is never replaced
        with pytest.raises(prepare_translation.PrepareError,
                           match="is not empty and holds no earlier preparation .*not even with "
                                 "--force; choose another --dest"):
            prepare_translation.prepare(Preparation(
                str(tmp_path / "raw"), str(tmp_path / "c"), "de", "en",
                splits, force=force))
    assert (tmp_path / "c" / "keep.txt").read_text() == "mine"
    (tmp_path / "c" / "prepare.json").write_text("{}")  # an earlier preparation
    with pytest.raises(prepare_translation.PrepareError,
                       match="holds an earlier preparation; pass --force to replace it"):
        prepare_translation.prepare(Preparation(
            str(tmp_path / "raw"), str(tmp_path / "c"), "de", "en", splits))
    # --force replaces it only once the input is good: here test.* are still empty
    with pytest.raises(prepare_translation.PrepareError, match="are empty"):
        prepare_translation.prepare(Preparation(
            str(tmp_path / "raw"), str(tmp_path / "c"), "de", "en", splits,
            force=True))
    assert (tmp_path / "c" / "keep.txt").read_text() == "mine"
    os.symlink(tmp_path / "c", tmp_path / "link")
    with pytest.raises(prepare_translation.PrepareError,
                       match="--dest .*link is a symbolic link; give the directory it points to"):
        prepare_translation.prepare(Preparation(
            str(tmp_path / "raw"), str(tmp_path / "link"), "de", "en",
            splits, force=True))


def test_prepare_force_replaces_only_what_the_earlier_preparation_wrote(tmp_path):
    """--force deletes the earlier preparation's files (here of another language pair), never
    the user's own files next to them."""
    splits = {"train": "train", "valid": "valid", "test": "test"}
    write_slice(tmp_path / "raw", n_train=300, n_eval=5)
    dest = tmp_path / "data-bin"
    (dest / "text").mkdir(parents=True)
    (dest / "mymodels").mkdir()
    for name in ("prepare.json", "dict.fr.txt", "train.fr-en.fr.bin", "valid1.fr-en.en.idx",
                 "train.fr-en.en.pt1.idx",  # a fairseq-preprocess worker's part, left unmerged
                 "text/train.fr", "notes.txt", "mymodels/checkpoint_best.pt"):
        (dest / name).write_text("earlier")
    prepare_translation.prepare(Preparation(str(tmp_path / "raw"), str(dest), "de", "en", splits,
                                bpe_merges=50, force=True))
    assert sorted(os.listdir(dest)) == sorted([
        ".annotated-prepare", "prepare.json", "bpe.codes", "text", "raw", "preprocess.log",
        "prepare.log",
        "dict.de.txt", "dict.en.txt", "notes.txt", "mymodels",
        *(f"{split}.de-en.{lang}.{ext}" for split in splits for lang in ("de", "en")
          for ext in ("bin", "idx"))])
    assert sorted(os.listdir(dest / "text")) == sorted(f"{split}.{lang}" for split in splits
                                                       for lang in ("de", "en"))
    assert (dest / "notes.txt").read_text() == "earlier"
    assert (dest / "mymodels" / "checkpoint_best.pt").read_text() == "earlier"


def test_prepare_refuses_text_that_is_not_utf8_and_too_few_merges(tmp_path):
    splits = {"train": "train", "valid": "valid", "test": "test"}
    write_slice(tmp_path / "raw", n_train=50, n_eval=5)
    (tmp_path / "raw" / "valid.de").write_bytes("Ich bin fertig.\nIch bin müde.\n".encode(
        "latin-1") * 200 + b"x\n")
    with pytest.raises(prepare_translation.PrepareError,
                       match=r"valid.de is not UTF-8 text \(byte 0xfc at line 2, byte 10\); "
                             r"convert it, e.g. iconv -f latin1"):
        prepare_translation.prepare(Preparation(
            str(tmp_path / "raw"), str(tmp_path / "a"), "de", "en", splits))
    with pytest.raises(prepare_translation.PrepareError, match="--bpe-merges 0: give a number"):
        prepare_translation.prepare(Preparation(
            str(tmp_path / "raw"), str(tmp_path / "b"), "de", "en", splits,
            bpe_merges=0))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_prepare_refuses_a_file_as_destination_a_destination_holding_the_raw_text_and_no_merges(
        tmp_path):
    splits = {"train": "train", "valid": "valid", "test": "test"}
    write_slice(tmp_path / "raw", n_train=50, n_eval=5)
    (tmp_path / "file").write_text("mine")
    with pytest.raises(prepare_translation.PrepareError, match="--dest .*file is a file; give a "
                                                               "directory"):
        prepare_translation.prepare(Preparation(
            str(tmp_path / "raw"), str(tmp_path / "file"), "de", "en",
            splits))
    for dest in (tmp_path / "raw", tmp_path):  # --force would delete the raw text
        with pytest.raises(prepare_translation.PrepareError,
                           match="--raw-dir .* is inside --dest .*, which the preparation replaces"):
            prepare_translation.prepare(Preparation(
                str(tmp_path / "raw"), str(dest), "de", "en", splits,
                force=True))
    assert len(read_lines(tmp_path / "raw" / "train.de")) == 50
    # two sentences share no pair of symbols twice: subword-nmt learns no merge
    for split in splits:
        (tmp_path / "raw" / f"{split}.de").write_text("ab\n")
        (tmp_path / "raw" / f"{split}.en").write_text("cd\n")
    with pytest.raises(prepare_translation.PrepareError,
                       match="no pair of symbols occurs twice in train.de \\+ train.en, so BPE "
                             "learnt no merge: give more text"):
        prepare_translation.prepare(Preparation(
            str(tmp_path / "raw"), str(tmp_path / "new"), "de", "en",
            splits))
    assert not (tmp_path / "new").exists()


def test_short_run_generates_and_scores_with_sacrebleu(trained):
    w, ckpt = trained
    output = w / "hypotheses.txt"
    proc = cli("annotated-evaluate-bleu", w / "bin", ckpt / "checkpoint_last.pt", "--examples", "2",
               "--output", output)
    lines = proc.stdout.splitlines()
    assert any(line.startswith("BLEU = ") and "(test, beam 5, lenpen 1, 60 sentences)" in line
               for line in lines)
    assert any(line.startswith("signature: nrefs:1|case:mixed|eff:no|tok:13a") for line in lines)
    assert any(line.startswith("chrF2 = ") and "(test, beam 5, lenpen 1, 60 sentences)" in line
               for line in lines)
    assert any(line.startswith("signature: nrefs:1|case:mixed|eff:yes|nc:6|nw:0|space:no")
               for line in lines)
    assert sum(line.strip().startswith("hypothesis") for line in lines) == 2
    # fairseq-generate's output and log, next to the checkpoint
    assert "H-59\t" in (ckpt / "generate-test.txt").read_text()
    assert "Translated 60 sentences" in (ckpt / "generate-test.log").read_text()
    # the score is sacreBLEU of the detokenised hypotheses (no BPE left) against the raw text
    import sacrebleu

    detokenised = {int(line.split("\t")[0][2:]): line.split("\t", 2)[2]
                   for line in (ckpt / "generate-test.txt").read_text().splitlines()
                   if line.startswith("D-")}
    hyps = [detokenised[i] for i in range(60)]
    assert not any("@@" in h for h in hyps)
    # each D- line is its H- line with the BPE joined and Moses-detokenised
    from sacremoses import MosesDetokenizer

    tokenised = {int(line.split("\t")[0][2:]): (line.split("\t", 2)[2] + " ").replace("@@ ", "")
                 for line in (ckpt / "generate-test.txt").read_text().splitlines()
                 if line.startswith("H-")}
    detokenise = MosesDetokenizer("en").detokenize
    assert hyps == [detokenise(tokenised[i].split()) for i in range(60)]
    assert "'tokenizer': {'_name': 'moses'" in (ckpt / "generate-test.log").read_text()
    refs = (w / "bin" / "raw" / "test.en").read_text(encoding="utf-8").splitlines()
    printed = next(line for line in lines if line.startswith("BLEU = ")).split()[2]
    assert printed == f"{sacrebleu.corpus_bleu(hyps, [refs]).score:.2f}"
    printed = next(line for line in lines if line.startswith("chrF2 = ")).split()[2]
    assert printed == f"{sacrebleu.corpus_chrf(hyps, [refs]).score:.2f}"
    # (a barely trained model scores near 0 whatever the order: the hypotheses scored are the
    # D- lines in the test set's order, as --output writes them)
    assert output.read_text(encoding="utf-8").splitlines() == hyps
    # the length penalty is chosen on the validation set, and reaches fairseq-generate, as do
    # the length limits (fairseq's --max-len-a, --max-len-b)
    proc = cli("annotated-evaluate-bleu", w / "bin", ckpt / "checkpoint_last.pt", "--examples", "0",
               "--subset", "valid", "--lenpen", "1.5", "--max-len-b", "3")
    assert "(valid, beam 5, lenpen 1.5, " in proc.stdout
    log = (ckpt / "generate-valid.log").read_text()
    assert "'lenpen': 1.5" in log and "'max_len_b': 3" in log
    assert max(len(line.split("\t", 2)[2].split()) for line in
               (ckpt / "generate-valid.txt").read_text().splitlines() if line.startswith("H-")) <= 3


@pytest.mark.main_lane  # the plugin's own checks of its input, before fairseq runs
def test_evaluation_refuses_bad_input_in_one_line_and_keeps_earlier_outputs(trained, tmp_path):
    w, _ = trained
    proc = cli("annotated-evaluate-bleu", w / "bin", tmp_path / "checkpoint_bst.pt", check=False)
    assert_one_line_error(proc, f"annotated-evaluate-bleu: error: no checkpoint "
                                f"{tmp_path}/checkpoint_bst.pt; give the path of a .pt file")
    proc = cli("annotated-evaluate-bleu", tmp_path, w / "checkpoints" / "checkpoint_last.pt",
               check=False)
    assert_one_line_error(proc, f"annotated-evaluate-bleu: error: {tmp_path} has no prepare.json")
    # fairseq-generate fails on a file that is no checkpoint: the earlier outputs stay
    (tmp_path / "broken.pt").write_bytes(b"not a checkpoint")
    for name in ("generate-test.txt", "generate-test.log"):
        (tmp_path / name).write_text("an earlier run's")
    proc = cli("annotated-evaluate-bleu", w / "bin", tmp_path / "broken.pt", check=False)
    assert_one_line_error(proc, "annotated-evaluate-bleu: error: fairseq-generate failed (exit 1); "
                                f"see {tmp_path}/generate-test.new.log")
    for name in ("generate-test.txt", "generate-test.log"):
        assert (tmp_path / name).read_text() == "an earlier run's"
    # a directory as --output is refused before the test set is decoded
    proc = cli("annotated-evaluate-bleu", w / "bin", w / "checkpoints" / "checkpoint_last.pt",
               "--output", tmp_path, check=False)
    assert_one_line_error(proc, f"annotated-evaluate-bleu: error: --output {tmp_path} is a "
                                f"directory; give a file name, e.g. {tmp_path}/hypotheses.txt")
    assert "fairseq-generate" not in proc.stderr
    # nor an input: the checkpoint stays
    checkpoint = w / "checkpoints" / "checkpoint_last.pt"
    before = checkpoint.read_bytes()
    proc = cli("annotated-evaluate-bleu", w / "bin", checkpoint, "--output", checkpoint,
               check=False)
    assert_one_line_error(proc, f"annotated-evaluate-bleu: error: --output {checkpoint} is one of "
                                f"this command's inputs; give another path (inputs are kept)")
    assert checkpoint.read_bytes() == before


def test_averaging_two_checkpoints_gives_the_mean_and_still_generates(trained, tmp_path):
    w, ckpt = trained
    out = tmp_path / "avg.pt"
    average_checkpoints.main(["--inputs", str(ckpt), "--num-epoch-checkpoints", "2",
                              "--output", str(out)])
    a = torch.load(ckpt / "checkpoint1.pt")["model"]
    b = torch.load(ckpt / "checkpoint2.pt")["model"]
    avg = torch.load(out)["model"]
    assert set(avg) == set(a)
    for k in a:
        if a[k].is_floating_point():
            assert torch.allclose(avg[k], (a[k] + b[k]) / 2, atol=1e-7), k
        else:  # the fingerprint of the dictionaries: the same in both
            assert torch.equal(avg[k], a[k]) and torch.equal(a[k], b[k]), k
    assert not torch.equal(a["decoder.layers.0.feed_forward.w_1.weight"],
                           b["decoder.layers.0.feed_forward.w_1.weight"])
    echoed = []
    hyps, _ = evaluate_bleu.generate_detokenised(str(w / "bin"), str(out), beam=2, max_tokens=300,
                                                 echo=lambda text, flush=True: echoed.append(text))
    assert len(hyps) == 60
    # a progress line per batch (fairseq logs from its second batch on)
    batches = [re.fullmatch(r"  batch (\d+)/(\d+), \d+ target tokens/s, about [\d.]+ min left",
                            text) for text in echoed[1:]]
    assert all(batches) and len(batches) >= 2, echoed
    total = int(batches[0][2])
    assert [int(m[1]) for m in batches] == list(range(2, total + 1))


def test_averaging_reads_eval_bleu_metrics_and_keeps_the_state_of_the_input_trained_longest(
        trained, tmp_path):
    """--eval-bleu saves numpy arrays of n-gram counts in each checkpoint; inputs given newest
    first still give the newest's epoch and updates (what --restore-file resumes from)."""
    import numpy as np

    _, ckpt = trained
    inputs = []
    for epoch in (2, 1):
        state = torch.load(ckpt / f"checkpoint{epoch}.pt", weights_only=False)
        state["extra_state"]["metrics"] = {"valid": [("_bleu_counts_0", np.array([9, 7], np.int64))]}
        torch.save(state, tmp_path / f"checkpoint{epoch}.pt")
        inputs.append(str(tmp_path / f"checkpoint{epoch}.pt"))
    out = tmp_path / "new" / "avg.pt"  # a directory that does not exist yet
    average_checkpoints.main(["--inputs", *inputs, "--output", str(out)])
    averaged, newest, older = (torch.load(path, weights_only=False) for path in [out] + inputs)
    epoch = lambda state: state["extra_state"]["train_iterator"]["epoch"]  # noqa: E731
    updates = lambda state: state["optimizer_history"][-1]["num_updates"]  # noqa: E731
    assert epoch(averaged) == epoch(newest) == epoch(older) + 1
    assert updates(averaged) == updates(newest) > updates(older)
    assert averaged["extra_state"]["metrics"]["valid"][0][1].tolist() == [9, 7]
    assert os.listdir(tmp_path / "new") == ["avg.pt"]


def test_averaging_refuses_a_directory_as_output_before_averaging(trained, tmp_path):
    _, ckpt = trained
    exited = exit_code(average_checkpoints.main,
                       ["--inputs", str(ckpt / "checkpoint1.pt"), "--output",
                                  str(tmp_path), "--force"])
    assert str(exited) == (
        f"annotated-average-checkpoints: error: --output {tmp_path} is a directory; give a file "
        f"name, e.g. {tmp_path}/checkpoint_avg.pt")
    assert os.listdir(tmp_path) == []


def test_averaging_refuses_different_architectures(trained, tmp_path):
    _, ckpt = trained
    other = torch.load(ckpt / "checkpoint1.pt")
    other["cfg"]["model"]["_name"] = "transformer"  # the model's options are a dict (a dataclass)
    torch.save(other, tmp_path / "other.pt")
    with pytest.raises(PluginError, match="different architectures: .* is "
                                          "annotated_transformer_tiny, .* is transformer"):
        average_checkpoints.average([str(ckpt / "checkpoint1.pt"), str(tmp_path / "other.pt")])


def test_the_last_checkpoints_are_picked_by_number_not_by_name(tmp_path):
    """checkpoint10.pt is newer than checkpoint9.pt; checkpoint_best/last.pt are not epochs."""
    for name in ("checkpoint9.pt", "checkpoint10.pt", "checkpoint2.pt", "checkpoint_best.pt",
                 "checkpoint_last.pt", "checkpoint_1_900.pt", "checkpoint_1_1000.pt",
                 "checkpoint_1_500.pt", "checkpoint_3_1000.pt.tmp"):
        (tmp_path / name).touch()
    assert average_checkpoints.last_checkpoints(str(tmp_path), 2) == [
        str(tmp_path / "checkpoint9.pt"), str(tmp_path / "checkpoint10.pt")]
    assert average_checkpoints.last_checkpoints(str(tmp_path), 2, by_update=True) == [
        str(tmp_path / "checkpoint_1_900.pt"), str(tmp_path / "checkpoint_1_1000.pt")]


def test_averaging_refuses_to_overwrite_and_to_average_too_few(trained, tmp_path):
    _, ckpt = trained
    with pytest.raises(PluginError, match="asked for the last 5 epoch"):
        average_checkpoints.last_checkpoints(str(ckpt), 5)
    existing = tmp_path / "exists.pt"
    existing.write_text("precious")
    with pytest.raises(SystemExit, match="already exists; choose another output or pass --force"):
        average_checkpoints.main(["--inputs", str(ckpt / "checkpoint1.pt"),
                                  "--output", str(existing)])
    assert existing.read_text() == "precious"
    # --force replaces an earlier output, never one of the inputs (the last epoch, say)
    before = (ckpt / "checkpoint2.pt").read_bytes()
    for force in (["--force"], []):
        exited = exit_code(average_checkpoints.main,
                           ["--inputs", str(ckpt), "--num-epoch-checkpoints", "2",
                                      "--output", str(ckpt / "checkpoint2.pt"), *force])
        assert str(exited) == (
            f"annotated-average-checkpoints: error: --output {ckpt / 'checkpoint2.pt'} is one of "
            f"this command's inputs; give another path (inputs are kept)")
    assert (ckpt / "checkpoint2.pt").read_bytes() == before
    # an input that is missing is named as such, --force or not
    with pytest.raises(SystemExit, match="no checkpoint at"):
        average_checkpoints.main(["--inputs", str(tmp_path / "missing.pt"),
                                  str(ckpt / "checkpoint1.pt"), "--output", str(existing),
                                  "--force"])
    assert existing.read_text() == "precious"


@pytest.mark.parametrize("args, message", [
    (["--inputs", "{tmp}/ckpts", "--num-epoch-checkpoints", "5"],
     "--num-epoch-checkpoints: {tmp}/ckpts is no directory; give the --save-dir"),
    (["--inputs", "{tmp}"], "{tmp} is a directory: add --num-epoch-checkpoints N"),
    (["--inputs", "{tmp}", "--num-epoch-checkpoints", "0"],
     "--num-epoch-checkpoints 0: average at least 1 checkpoint"),
    (["--inputs", "{tmp}", "--num-update-checkpoints", "-2"],
     "--num-update-checkpoints -2: average at least 1 checkpoint")])
def test_averaging_explains_a_directory_or_count_it_cannot_use(args, message, tmp_path, capsys):
    exit_code(average_checkpoints.main,
              [a.format(tmp=tmp_path) for a in args]
                                 + ["--output", str(tmp_path / "avg.pt")])
    assert message.format(tmp=tmp_path) in capsys.readouterr().err.strip().splitlines()[-1]


def test_python_api_translates_like_fairseq_generate(prepared, trained):
    from fairseq_plugin import AnnotatedTransformerModel

    w, _ = prepared
    _, ckpt = trained
    hub = AnnotatedTransformerModel.from_pretrained(
        str(ckpt), checkpoint_file="checkpoint_last.pt", data_name_or_path=str(w / "bin"),
        bpe="subword_nmt", bpe_codes=str(w / "bin" / "bpe.codes"), tokenizer="moses",
        source_lang="de", target_lang="en")
    hyps, settings = evaluate_bleu.generate_detokenised(str(w / "bin"),
                                                        str(ckpt / "checkpoint_last.pt"))
    sources = (w / "bin" / "raw" / "test.de").read_text(encoding="utf-8").splitlines()
    scores = {int(line.split("\t")[0][2:]): float(line.split("\t")[1])  # base 2, as printed
              for line in (ckpt / "generate-test.txt").read_text().splitlines()
              if line.startswith("H-")}
    by_length = sorted(range(len(sources)), key=lambda i: len(sources[i]))
    for i in (by_length[0], by_length[len(by_length) // 2], by_length[-1]):
        assert hub.translate(sources[i], beam=5) == hyps[i]
        best = hub.generate([hub.encode(sources[i])], beam=5)[0][0]
        assert best["score"].item() / math.log(2) == pytest.approx(scores[i], abs=1e-4)


def test_iwslt14_files_become_train_valid_test(tmp_path):
    """The IWSLT'14 layout: tagged training text and XML test sets."""
    d = tmp_path / "de-en"
    d.mkdir()
    for lang, word in (("de", "Satz"), ("en", "sentence")):
        lines = ["<url>http://www.ted.com/talks/x</url>", "<talkid>1</talkid>",
                 f"<title>Titel {lang}</title>", f"<description>TED: {word}</description>"]
        lines += [f"{word} {i} ." for i in range(50)]
        (d / f"train.tags.de-en.{lang}").write_text("\n".join(lines) + "\n", encoding="utf-8")
        for name in corpora.IWSLT_TEST_SETS:
            (d / f"{name}.de-en.{lang}.xml").write_text(
                f'<refset><doc docid="1">\n<seg id="1"> {name} {word} eins </seg>\n'
                f'<seg id="2">{name} {word} zwei</seg>\n</doc></refset>\n', encoding="utf-8")
    raw = corpora.iwslt14_to_raw(str(d), str(tmp_path / "raw"))
    read = lambda name: open(os.path.join(raw, name), encoding="utf-8").read().splitlines()  # noqa: E731
    train, valid, test = read("train.en"), read("valid.en"), read("test.en")
    assert len(train) + len(valid) == 52 and len(valid) == 2  # every 23rd line
    assert train[0] == "Titel en" and train[1] == "TED: sentence"
    assert not any("<" in line for line in train + valid)
    assert test[0] == "IWSLT14.TED.dev2010 sentence eins" and len(test) == 10
    assert len(read("test.de")) == 10 and read("valid.de")[0] == valid[0].replace("sentence", "Satz")
    os.remove(d / "IWSLT14.TED.tst2012.de-en.en.xml")
    with pytest.raises(prepare_translation.PrepareError,
                       match="missing .*/IWSLT14.TED.tst2012.de-en.en.xml: --raw-dir for iwslt14 is "
                             "the extracted de-en/ folder"):
        corpora.iwslt14_to_raw(str(d), str(tmp_path / "raw2"))


def test_attention_heatmaps_are_pngs_of_rows_summing_to_one(prepared, trained, tmp_path):

    w, _ = prepared
    _, ckpt = trained
    hub = heatmaps.load_hub(str(w / "bin"), str(ckpt / "checkpoint_last.pt"))
    # this 2-epoch model repeats a word up to fairseq's length limit: keep the maps small
    translation, drawn = heatmaps.write_heatmaps(hub, "Tom öffnete das Bier.",
                                                 str(tmp_path / "all"), max_len_b=12)
    assert len(drawn) == 3 * 2 * 4  # kinds x layers x heads of annotated_transformer_tiny
    assert sorted(os.listdir(tmp_path / "all")) == sorted(os.path.basename(p) for p in drawn)
    for path, weights in drawn.items():
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        for row in weights:
            assert abs(sum(row) - 1.0) < 1e-5
    for kind in ("encoder_self", "decoder_self", "decoder_source"):  # each head its own map
        for layer in range(2):
            maps = [drawn[str(tmp_path / "all" / f"{kind}_layer{layer}_head{h}.png")]
                    for h in range(4)]
            assert len({repr(m) for m in maps}) == 4, (kind, layer)
    for p, wts in drawn.items():  # the decoder's self-attention sees no later position
        if "decoder_self" in p:
            assert all(w == 0 for i, row in enumerate(wts) for w in row[i + 1:]), p
    decoder_rows = {len(wts) for p, wts in drawn.items() if "decoder" in p}
    assert len(decoder_rows) == 1 and decoder_rows.pop() <= 12 + 1  # max_len_b tokens + eos
    source_maps = [wts for p, wts in drawn.items() if "decoder_source" in p]
    n_source = len(hub.encode("Tom öffnete das Bier."))
    assert all(len(row) == n_source for wts in source_maps for row in wts)
    _, some = heatmaps.write_heatmaps(hub, "Tom öffnete das Bier.", str(tmp_path / "one"),
                                      layers={1}, heads={0}, max_len_b=12)
    assert sorted(os.path.basename(p) for p in some) == [
        "decoder_self_layer1_head0.png", "decoder_source_layer1_head0.png",
        "encoder_self_layer1_head0.png"]


@pytest.mark.main_lane  # the heat-map command's own input checks, whatever fairseq's version
@pytest.mark.parametrize("checkpoint, sentence, extra, message", [
    ("checkpoint_last.pt", "   ", [], "the sentence is empty"),
    ("checkpoint_last.pt", "Tom öffnete das Bier.", ["--layers", "2"],
     "--layers 2: this model has layers 0 to 1"),
    ("checkpoint_last.pt", "Tom öffnete das Bier.", ["--heads", "x"],
     "--heads x: give comma-separated numbers"),
    ("checkpoint_last.pt", "Tom öffnete das Bier.", ["--heads", "0,4"],
     "--heads 0,4: this model has heads 0 to 3"),
    ("checkpoint_bst.pt", "Tom öffnete das Bier.", [], "no checkpoint {ckpt}/checkpoint_bst.pt")])
def test_heatmaps_refuse_a_missing_checkpoint_an_empty_sentence_and_absent_layers_or_heads(
        prepared, trained, tmp_path, checkpoint, sentence, extra, message):
    """(the command's main, in this process: test_errors shows that its console script exits
    with the line it exits with)"""
    w, _ = prepared
    _, ckpt = trained
    refused = exit_code(heatmaps.main,
                        [str(w / "bin"), str(ckpt / checkpoint), sentence,
                       "--out-dir", str(tmp_path / "maps"), *extra])
    line = str(refused)
    assert line.startswith("annotated-attention-heatmaps: error: " + message.format(ckpt=ckpt))
    assert "\n" not in line
    assert not (tmp_path / "maps").exists()


def test_heatmaps_refuse_fairseqs_transformer_and_a_missing_matplotlib(prepared, trained, tmp_path,
                                                                      monkeypatch, capsys):
    from fairseq_plugin import export

    w, _ = prepared
    _, ckpt = trained
    exported = tmp_path / "transformer.pt"
    export.export(str(ckpt / "checkpoint_last.pt"), str(exported), str(w / "bin"))
    with pytest.raises(PluginError, match="transformer.pt holds a TransformerModel: the heat-maps "
                                          "record this plugin's attention; give an "
                                          "annotated_transformer checkpoint"):
        heatmaps.load_hub(str(w / "bin"), str(exported))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    with pytest.raises(SystemExit, match="annotated-attention-heatmaps: error: drawing the "
                                         "heat-maps needs matplotlib: pip install matplotlib"):
        heatmaps.main([str(w / "bin"), str(ckpt / "checkpoint_last.pt"), "Hallo.",
                       "--out-dir", str(tmp_path / "maps")])
    assert not (tmp_path / "maps").exists()


def test_heatmaps_refuse_a_file_as_output_directory_before_translating(prepared, trained,
                                                                        tmp_path, monkeypatch):
    w, _ = prepared
    _, ckpt = trained
    (tmp_path / "maps").write_text("mine")
    monkeypatch.setattr(heatmaps, "load_hub", None)  # not reached
    exited = exit_code(heatmaps.main,
                       [str(w / "bin"), str(ckpt / "checkpoint_last.pt"), "Hallo.",
                       "--out-dir", str(tmp_path / "maps")])
    assert str(exited) == (f"annotated-attention-heatmaps: error: --out-dir "
                                 f"{tmp_path}/maps is a file; give a directory for the heat-maps")
    assert (tmp_path / "maps").read_text() == "mine"


def test_the_demo_goes_on_only_over_a_data_bin_an_earlier_demo_made(tmp_path):

    demo = runpy.run_path(os.path.join(REPO, "scripts", "translation_demo.py"))
    data_bin = tmp_path / "work" / "data-bin"
    data_bin.mkdir(parents=True)
    (data_bin / "notes.txt").write_text("mine")
    not_ours = "is not empty and no earlier run of this demo made it"
    with pytest.raises(PluginError, match=not_ours):
        demo["main"](["--work-dir", str(tmp_path / "work")])
    assert (data_bin / "notes.txt").read_text() == "mine"
    # someone's fairseq-train --save-dir checkpoints in the folder: refused, kept
    (tmp_path / "mine" / "checkpoints").mkdir(parents=True)
    (tmp_path / "mine" / "checkpoints" / "checkpoint_last.pt").write_text("mine")
    with pytest.raises(PluginError, match=not_ours):
        demo["main"](["--work-dir", str(tmp_path / "mine")])
    assert os.listdir(tmp_path / "mine") == ["checkpoints"]
    # another corpus prepared with the demo's languages and merges: refused
    settings = {"source_lang": "de", "target_lang": "en", "bpe_merges": demo["BPE_MERGES"],
                "splits": {"train": 5000, "valid": 1000, "test": 1000}}
    (data_bin / "prepare.json").write_text(json.dumps(settings))
    with pytest.raises(PluginError, match=not_ours):
        demo["check_work_dir"](str(tmp_path / "work"))
    # an earlier demo's finished preparation, or its marker (a run stopped half-way): replaced
    settings["splits"] = {split: sum(1 for _ in gzip.open(os.path.join(BUNDLED, f"{split}.en.gz")))
                          for split in ("train", "valid", "test")}
    assert settings["splits"] == demo["BUNDLED_PAIRS"]
    (data_bin / "prepare.json").write_text(json.dumps(settings))
    demo["check_work_dir"](str(tmp_path / "work"))
    (data_bin / "prepare.json").unlink()
    (tmp_path / "work" / demo["MARKER"]).touch()
    demo["check_work_dir"](str(tmp_path / "work"))


class StopAtTraining(Exception):
    pass


def test_a_second_run_of_the_demos_trains_afresh_instead_of_resuming(tmp_path, monkeypatch):
    """fairseq-train resumes WORK_DIR/checkpoints/checkpoint_last.pt on its own: the demos remove
    an earlier run's checkpoints before training (and the reverse demo its whole output, as
    fairseq-preprocess refuses existing dictionaries)."""
    from fairseq_plugin.cli import reverse_task

    for script, train_step in (("translation_demo.py", "fairseq-train"),
                               ("reverse_demo.py", "fairseq-preprocess")):
        main = runpy.run_path(os.path.join(REPO, "scripts", script))["main"]
        work = tmp_path / script
        checkpoints = work / "checkpoints"
        checkpoints.mkdir(parents=True)
        (checkpoints / "checkpoint_last.pt").write_text("an earlier run's")
        script_globals = inspect.unwrap(main).__globals__  # (main is stops_in_one_line's)
        (work / script_globals["MARKER"]).touch()
        seen = []

        def run(cmd, *args, **kwargs):
            if os.path.basename(str(cmd[0])) == train_step:
                seen.append(sorted(os.listdir(checkpoints)) if checkpoints.exists() else [])
                raise StopAtTraining
        monkeypatch.setitem(script_globals, "run", run)
        monkeypatch.setattr(prepare_translation, "prepare", lambda *args, **kwargs: None)
        monkeypatch.setattr(reverse_task, "main", lambda argv, task="reverse": None)
        with pytest.raises(StopAtTraining):
            main(["--work-dir", str(work)])
        assert seen == [[]], script


def test_the_reverse_demo_refuses_a_work_dir_it_did_not_make_and_bad_sizes(tmp_path):
    main = runpy.run_path(os.path.join(REPO, "scripts", "reverse_demo.py"))["main"]
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(PluginError, match="is not empty and no earlier run of this demo made it"):
        main(["--work-dir", str(tmp_path)])
    assert os.listdir(tmp_path) == ["notes.txt"]
    for flag in ("--epochs", "--train-size"):
        exit_code(main, ["--work-dir", str(tmp_path / "new"), flag, "0"])
    assert not (tmp_path / "new").exists()


def test_no_valid_or_test_sentence_of_the_bundled_sample_occurs_in_its_training_data():
    """On either side, after punctuation normalisation and tokenisation (the sample's grouping
    key, which also catches sentences differing only in their quotes or dashes)."""
    grouping_key = runpy.run_path(os.path.join(REPO, "scripts", "make_tatoeba_sample.py"))[
        "grouping_key"]

    def read(split, lang):
        with gzip.open(os.path.join(BUNDLED, f"{split}.{lang}.gz"), "rt", encoding="utf-8") as f:
            return [line.rstrip("\n") for line in f]

    def letters(sentence):  # equal normalised sentences have equal letters and digits
        return "".join(c for c in sentence if c.isalnum())

    for lang in ("de", "en"):
        normalise = grouping_key(lang)
        train = {}
        for sentence in read("train", lang):
            train.setdefault(letters(sentence), set()).add(sentence)
        leaks = [(split, s, t) for split in ("valid", "test") for s in read(split, lang)
                 for t in train.get(letters(s), ()) if normalise(t) == normalise(s)]
        assert not leaks, f"{len(leaks)} {lang} sentences leak into train, e.g. {leaks[:3]}"


def test_prepare_keeps_pairs_aligned_across_carriage_returns_and_leaves_out_empty_training_pairs(
        tmp_path, capsys):
    """A carriage return inside a line (not a line end) becomes a space instead of splitting the
    line; a training pair with an empty side is left out, and said so."""
    raw = tmp_path / "raw"
    write_slice(raw, n_train=200, n_eval=5)
    de = (raw / "train.de").read_text(encoding="utf-8").splitlines()
    en = (raw / "train.en").read_text(encoding="utf-8").splitlines()
    de[1] = de[1].replace(" ", "\r", 1)
    en[3] = ""
    en[4] = en[4] + "\r"  # a CRLF line among LF ones
    (raw / "train.de").write_bytes("\n".join(de + [""]).encode("utf-8"))
    (raw / "train.en").write_bytes("\n".join(en + [""]).encode("utf-8"))
    settings = prepare_translation.prepare(Preparation(str(raw), str(tmp_path / "bin"), "de", "en",
                                           {"train": "train", "valid": "valid", "test": "test"},
                                           bpe_merges=100))
    assert "train: left out 1 pairs with an empty side (lines 4)" in capsys.readouterr().err
    assert settings["splits"]["train"] == 199 and settings["train_pairs_left_out_empty"] == 1
    tokenised = {lang: read_lines(tmp_path / "bin" / "text" / f"train.{lang}")
                 for lang in ("de", "en")}
    assert len(tokenised["de"]) == len(tokenised["en"]) == 199
    # the pair after the left-out one is still a pair: the same as tokenised on its own
    bpe_de = tokenised["de"][3].replace("@@ ", "")
    assert bpe_de == streaming.moses_tokenizer("de")(" ".join(de[4].split()))
    assert tokenised["de"][1].replace("@@ ", "") == streaming.moses_tokenizer("de")(
        " ".join(de[1].split()))


@pytest.mark.parametrize("change, message", [
    ({"source_lang": "pt.br"}, "--source-lang pt.br: use letters, digits and _ only (fairseq "
                               "splits its file names at '.' and '-'), e.g. pt_br"),
    ({"target_lang": "de"}, "--source-lang and --target-lang are both de; give two different "
                            "codes"),
    ({"workers": 0}, "--workers 0: give at least 1 process"),
    ({"directory": "train.de"}, "cannot read {raw}/train.de ([Errno 21] Is a directory: "
                                "'{raw}/train.de'); give plain or gzipped UTF-8 text"),
    ({"false_gz": "train.de"}, "cannot read {raw}/train.de.gz (Not a gzipped file (b'Er')); give "
                               "plain or gzipped UTF-8 text"),
])
def test_prepare_refuses_bad_languages_workers_and_unreadable_files_before_writing(
        tmp_path, change, message):
    raw = tmp_path / "raw"
    write_slice(raw, n_train=20, n_eval=5)
    if "directory" in change:
        (raw / change["directory"]).unlink()
        (raw / change["directory"]).mkdir()
    if "false_gz" in change:
        (raw / change["false_gz"]).rename(raw / (change["false_gz"] + ".gz"))
    arguments = {"source_lang": "de", "target_lang": "en", "workers": 2}
    arguments.update((k, v) for k, v in change.items() if k in arguments)
    with pytest.raises(prepare_translation.PrepareError) as refused:
        prepare_translation.prepare(Preparation(
            str(raw), str(tmp_path / "bin"), arguments["source_lang"],
            arguments["target_lang"],
            {"train": "train", "valid": "valid", "test": "test"},
            workers=arguments["workers"]))
    assert str(refused.value) == message.format(raw=raw)
    assert not (tmp_path / "bin").exists()


def test_iwslt14_from_an_archive_overwrites_no_folder_of_the_users(tmp_path):
    """The archive is unpacked into DEST.download, not next to it (where the user's own de-en/
    may be), and DEST.raw is refused when annotated-prepare did not make it; both before any
    download, unpacking or conversion."""
    import tarfile

    source = tmp_path / "source" / "de-en"
    source.mkdir(parents=True)
    for lang in ("de", "en"):
        (source / f"train.tags.de-en.{lang}").write_text(
            "".join(f"{lang} Satz {i} .\n" for i in range(60)), encoding="utf-8")
        for name in corpora.IWSLT_TEST_SETS:
            (source / f"{name}.de-en.{lang}.xml").write_text(
                f'<seg id="1">{lang} {name} eins</seg>\n', encoding="utf-8")
    archive = tmp_path / "de-en.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(source, arcname="de-en")
    mine = tmp_path / "de-en"  # the user's own folder next to the archive
    mine.mkdir()
    (mine / "train.tags.de-en.de").write_text("MY EDITED COPY\n")
    (tmp_path / "bin.raw").mkdir()
    (tmp_path / "bin.raw" / "train.de").write_text("mine too\n")
    refused = exit_code(prepare_translation.main,
                        ["--corpus", "iwslt14", "--raw-dir", str(archive),
                                  "--dest", str(tmp_path / "bin"), "--bpe-merges", "20"])
    assert str(refused) == (
        f"annotated-prepare: error: {tmp_path}/bin.raw exists and was not made by "
        f"annotated-prepare, which writes the converted text there; move it, or choose another "
        f"--dest")
    assert (tmp_path / "bin.raw" / "train.de").read_text() == "mine too\n"
    (tmp_path / "bin.raw" / "train.de").unlink()
    (tmp_path / "bin.raw").rmdir()
    prepare_translation.main(["--corpus", "iwslt14", "--raw-dir", str(archive),
                              "--dest", str(tmp_path / "bin"), "--bpe-merges", "20"])
    assert (mine / "train.tags.de-en.de").read_text() == "MY EDITED COPY\n"
    assert (tmp_path / "bin.download" / "de-en" / "train.tags.de-en.de").exists()
    assert json.loads((tmp_path / "bin" / "prepare.json").read_text())["splits"]["test"] == 5
