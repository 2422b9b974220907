"""fairseq-hydra-train with the YAML recipes of examples/configs: typed configs for the model (and
its presets), the criterion and noam; the checkpoints it writes work everywhere a fairseq-train one
does."""

import json
import math
import os
import re
import shutil

import pytest
import torch

from conftest import REPO, cli
from fairseq_plugin.cli import reverse_task
from fairseq_plugin.reference import rate as noam_rate

RECIPES = os.path.join(REPO, "examples", "configs")
EPOCHS = 2
JSON_EVERY_UPDATE = ["common.log_format=json", "common.log_interval=1"]


DATA_BIN = {"train": 2000, "valid": 100, "test": 20}  # the reverse task's pairs (conftest: data_bin)


def hydra_train(data_bin, work, *overrides, recipe="reverse", config_dir=RECIPES, check=True):
    os.makedirs(work, exist_ok=True)
    return cli("fairseq-hydra-train", "--config-dir", config_dir, "--config-name", recipe,
               f"task.data={data_bin}", f"checkpoint.save_dir={work}/checkpoints",
               f"hydra.run.dir={work}/hydra", *overrides, check=check, cwd=work)


def logged_updates(proc):
    """{update: (loss, lr)} from a JSON log at every update."""
    updates = {}
    for line in (proc.stdout + proc.stderr).splitlines():
        if "train_inner" in line and "{" in line:
            stats = json.loads(line[line.index("{"):])
            updates[int(stats["num_updates"])] = (stats["loss"], float(stats["lr"]))
    return updates


@pytest.fixture(scope="module")
def runs(data_bin, tmp_path_factory):
    """The reverse recipe through fairseq-hydra-train, and the same training on the command line
    (reverse_task.train_command, what scripts/reverse_demo.py runs)."""
    work = tmp_path_factory.mktemp("runs")
    hydra = hydra_train(data_bin, work / "hydra", f"optimization.max_epoch={EPOCHS}",
                        *JSON_EVERY_UPDATE)
    command = cli(*reverse_task.train_command(
        str(data_bin), str(work / "cli" / "checkpoints"), EPOCHS,
        extra=["--log-format", "json", "--log-interval", "1"]))
    return {"work": work, "hydra": hydra, "cli": command,
            "checkpoint": work / "hydra" / "checkpoints" / "checkpoint_last.pt"}


def test_a_hydra_recipe_builds_and_trains_the_same_model_as_the_command_line(runs):
    hydra, command = logged_updates(runs["hydra"]), logged_updates(runs["cli"])
    assert len(hydra) >= 10 and hydra == command  # the same loss and lr at every update
    ours = torch.load(runs["checkpoint"])
    theirs = torch.load(runs["work"] / "cli" / "checkpoints" / "checkpoint_last.pt")
    assert ours["cfg"]["model"] == theirs["cfg"]["model"]
    assert ours["cfg"]["model"]["_name"] == "annotated_transformer_tiny"
    assert all(torch.equal(ours["model"][k], theirs["model"][k]) for k in theirs["model"])


def test_noam_under_hydra_follows_the_formula_with_the_models_d_model(runs):
    log = runs["hydra"].stdout + runs["hydra"].stderr
    assert "noam: lr = 1.0 * 64^-0.5 * min(step^-0.5, step * 200^-1.5)" in log
    updates = logged_updates(runs["hydra"])
    assert len(updates) >= 10
    # fairseq logs the rate set after each update, for the next one (6 significant digits)
    for update, (_, lr) in updates.items():
        assert lr == pytest.approx(noam_rate(update, 64, 1.0, 200), rel=1e-5), update


def test_a_hydra_run_resumes_from_its_last_checkpoint(data_bin, runs, tmp_path):
    work = tmp_path / "resumed"
    shutil.copytree(runs["work"] / "hydra" / "checkpoints", work / "checkpoints")
    stopped_at = max(logged_updates(runs["hydra"]))
    proc = hydra_train(data_bin, work, f"optimization.max_epoch={EPOCHS + 1}", *JSON_EVERY_UPDATE)
    log = proc.stdout + proc.stderr
    assert (f"Loaded checkpoint {work / 'checkpoints' / 'checkpoint_last.pt'} "
            f"(epoch {EPOCHS + 1} @ {stopped_at} updates)") in log
    assert min(logged_updates(proc)) == stopped_at + 1


@pytest.mark.main_lane  # for CI's time; the 0.12.2 lane trains, resumes and refuses recipes
def test_a_hydra_checkpoint_works_in_generate_interactive_hub_export_and_restore_file(
        data_bin, runs, tmp_path):
    """All under torch >= 2.6's weights_only default, without TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD."""
    from fairseq_plugin import AnnotatedTransformerModel

    checkpoint = runs["checkpoint"]
    def hypotheses(output, column=2, kind=None):
        """{sentence: column} of fairseq's H- lines (S- lines for column 1 unless kind)."""
        kind = kind or ("H-", "S-")[column == 1]
        return {int(line.split("\t")[0][2:]): line.split("\t")[column]
                for line in output.splitlines() if line.startswith(kind)}

    generated = cli(*reverse_task.generate_command(str(data_bin), str(checkpoint))).stdout
    hyps, sources = hypotheses(generated), hypotheses(generated, column=1)
    assert len(hyps) == 20
    command_line = runs["work"] / "cli" / "checkpoints" / "checkpoint_last.pt"
    assert hypotheses(cli(*reverse_task.generate_command(str(data_bin), str(command_line))).stdout
                      ) == hyps  # the same model, the same translations

    # a model this briefly trained says much the same for every input: the scores tell the
    # inputs apart (fairseq prints them in base 2)
    scores = {i: float(score) for i, score in hypotheses(generated, column=1, kind="H-").items()}
    few = range(5)
    interactive = cli("fairseq-interactive", data_bin, "--user-dir", "fairseq_plugin", "--path",
                      checkpoint, "--beam", "5", "--cpu",
                      input="".join(sources[i] + "\n" for i in few)).stdout
    assert hypotheses(interactive) == {i: hyps[i] for i in few}
    interactive_scores = hypotheses(interactive, column=1, kind="H-")
    assert all(abs(float(interactive_scores[i]) - scores[i]) <= 1e-3 for i in few)

    hub = AnnotatedTransformerModel.from_pretrained(
        str(checkpoint.parent), checkpoint_file=checkpoint.name, data_name_or_path=str(data_bin))
    assert hub.translate(sources[0], beam=5) == hyps[0]
    best = hub.generate([hub.encode(sources[0])], beam=5)[0][0]
    assert abs(float(best["score"]) / math.log(2) - scores[0]) <= 1e-3

    cli("annotated-export-fairseq", checkpoint, "--output", tmp_path / "transformer.pt")
    exported = cli("fairseq-generate", data_bin, "--path", tmp_path / "transformer.pt",
                   "--beam", "5", "--max-tokens", "4096", "--required-batch-size-multiple", "1",
                   "--cpu").stdout
    assert hypotheses(exported) == hyps

    restored = cli(*reverse_task.train_command(
        str(data_bin), str(tmp_path / "restored"), EPOCHS + 1,
        extra=["--restore-file", str(checkpoint)]))
    assert f"Loaded checkpoint {checkpoint}" in restored.stdout + restored.stderr


def test_hydra_overrides_need_no_plus(data_bin, tmp_path):
    hydra_train(data_bin, tmp_path, "model.encoder_layers=1", "lr_scheduler.warmup_updates=100",
                "optimization.max_update=1")
    state = torch.load(tmp_path / "checkpoints" / "checkpoint_last.pt")
    assert state["cfg"]["model"]["encoder_layers"] == 1
    assert state["cfg"]["lr_scheduler"]["warmup_updates"] == 100
    assert "encoder.layers.0.feed_forward.w_1.weight" in state["model"]
    assert not any(k.startswith("encoder.layers.1.") for k in state["model"])


def test_hydra_validates_with_chrf_and_selects_checkpoints_by_it(data_bin, tmp_path):
    """The recipes' task, the plugin's annotated_translation: task.eval_chrf=true logs the
    validation chrF, and checkpoint.best_checkpoint_metric=chrf chooses by it (fairseq stops
    with a KeyError when the metric is not logged). Its value: tests/test_cli.py."""
    proc = hydra_train(data_bin, tmp_path, "task.eval_chrf=true",
                       "task.eval_bleu_args='{\"beam\": 1, \"max_len_b\": 5}'",
                       "checkpoint.best_checkpoint_metric=chrf",
                       "checkpoint.maximize_best_checkpoint_metric=true",
                       "optimization.max_epoch=2")
    validated = [line for line in (proc.stdout + proc.stderr).splitlines()
                 if "valid on 'valid' subset" in line]
    chrf = [float(re.search(r"\| chrf ([\d.]+) \|", line)[1]) for line in validated]
    # (this barely trained model's chrF may well be 0: it stops early)
    assert len(chrf) == 2 and all(0 <= c <= 100 for c in chrf), validated
    # the best so far, logged once a checkpoint is saved: chrF's
    assert float(re.search(r"\| best_chrf ([\d.]+)", validated[1])[1]) == max(chrf), validated
    state = torch.load(tmp_path / "checkpoints" / "checkpoint_last.pt")
    assert state["cfg"]["task"]["_name"] == "annotated_translation"
    assert state["cfg"]["task"]["eval_chrf"] is True


HYDRA_HINT = "Set the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace."


def assert_last_words(proc, message):
    """A failed job's stderr ends with the line holding ``message``, then at most hydra's hint
    about HYDRA_FULL_ERROR: one line, not the end of a dump."""
    lines = proc.stderr.strip().splitlines()
    at = max(i for i, line in enumerate(lines) if message in line)
    assert [line for line in lines[at + 1:] if line.strip()] in ([], [HYDRA_HINT]), lines[at:]


@pytest.mark.parametrize("override, message", [
    ("+model.encoder_layer=1",
     "unknown option model.encoder_layer: AnnotatedTransformerTinyConfig has no field "
     "'encoder_layer'; did you mean encoder_layers?"),
    ("+criterion.label_smothing=0.2",
     "unknown option criterion.label_smothing: AnnotatedLabelSmoothingConfig has no field "
     "'label_smothing'; did you mean label_smoothing?"),
    ("+lr_scheduler.warmup=3", "unknown option lr_scheduler.warmup: NoamConfig has no field "
                               "'warmup'"),
    ("model._name=annotated_transformer_huge", "unknown model "
     "model._name=annotated_transformer_huge; the annotated_transformer presets are "
     "annotated_transformer, annotated_transformer_big, "),
    # hydra's own refusal, before anything of fairseq's runs
    ("model.encoder_layer=1", "Could not override 'model.encoder_layer'"),
])
def test_an_unknown_option_is_refused_at_start_up_in_one_line(data_bin, tmp_path, override,
                                                              message):
    proc = hydra_train(data_bin, tmp_path, override, check=False)
    assert proc.returncode != 0
    if message.startswith("unknown"):  # ours
        assert_last_words(proc, message)
    else:  # hydra's own refusal, in its own words over a few lines
        assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "checkpoints" / "checkpoint_last.pt").exists()


def test_a_misspelled_key_in_a_recipe_file_is_refused_in_one_line(data_bin, tmp_path):
    with open(os.path.join(RECIPES, "reverse.yaml")) as f:
        recipe = f.read()
    assert "  encoder_ffn_embed_dim: 256\n" in recipe
    (tmp_path / "typo.yaml").write_text(
        recipe.replace("  encoder_ffn_embed_dim: 256\n", "  encoder_ffn_embed_dims: 256\n"))
    proc = hydra_train(data_bin, tmp_path, recipe="typo", config_dir=str(tmp_path), check=False)
    assert proc.returncode != 0
    assert_last_words(proc, "unknown option model.encoder_ffn_embed_dims: "
                            "AnnotatedTransformerTinyConfig has no field 'encoder_ffn_embed_dims'")
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("recipe, d_model", [("tatoeba", 128), ("multi30k", 256)])
def test_the_translation_recipes_build_their_model_and_train(data_bin, tmp_path, recipe, d_model):
    proc = hydra_train(data_bin, tmp_path, "optimization.max_update=2", recipe=recipe)
    assert f"noam: lr = 1.0 * {d_model}^-0.5" in proc.stdout + proc.stderr
    state = torch.load(tmp_path / "checkpoints" / "checkpoint_last.pt")
    assert state["cfg"]["model"]["_name"] == "annotated_transformer"
    assert state["model"]["encoder.layers.2.feed_forward.w_1.weight"].shape == (512, d_model)
