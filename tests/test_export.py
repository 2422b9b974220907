"""Export to fairseq's transformer and on to CTranslate2: same numbers out."""

import os
import subprocess
import sys
from argparse import Namespace
from types import SimpleNamespace

import pytest
import torch
from fairseq import models
from fairseq.sequence_generator import SequenceGenerator

from fairseq_plugin.cli import reverse_task
from conftest import FAIRSEQ_BREAKS_POST_LN, REPO, build_tiny_model, cli, make_dictionary
from fairseq_plugin.errors import PluginError
from fairseq_plugin.export import (
    load_into_transformer,
    logit_difference,
    logits_agree,
    sample_batch,
    transformer_args,
    transformer_state_dict,
)

# fairseq 0.12.2 cannot run a post-LN transformer encoder (conftest): the export refuses one there
POST_LN = "post-LN, learned positions, separate dictionaries"
POST_LN_ENCODER = {POST_LN, "post-LN encoder, pre-LN decoder (--decoder-normalize-before)"}

CONFIGS = {
    "pre-LN, sinusoids, all embeddings shared": dict(share_all_embeddings=True),
    POST_LN: dict(post_norm=True, encoder_learned_pos=True, decoder_learned_pos=True),
    "pre-LN encoder, post-LN decoder (--encoder-normalize-before)": dict(
        encoder_normalize_before=True),
    "post-LN encoder, pre-LN decoder (--decoder-normalize-before)": dict(
        decoder_normalize_before=True),
    "no positions, decoder input/output shared, gelu": dict(
        no_token_positional_embeddings=True, share_decoder_input_output_embed=True,
        activation_fn="gelu"),
}
RUNNABLE_CONFIGS = [pytest.param(name, marks=pytest.mark.skipif(
    name in POST_LN_ENCODER and FAIRSEQ_BREAKS_POST_LN,
    reason="fairseq 0.12.2 cannot run a post-LN transformer loaded from a state dict (#4858)"))
    for name in CONFIGS]


def exported_pair(**overrides):
    src = make_dictionary(40)
    tgt = src if overrides.get("share_all_embeddings") else make_dictionary(35)
    ours = build_tiny_model(src, tgt, **overrides)
    # random LayerNorm parameters too, so a swapped norm cannot go unnoticed
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if p.dim() == 1:
                p.normal_()
    args = transformer_args(ours_args(overrides))
    task = SimpleNamespace(source_dictionary=src, target_dictionary=tgt)
    theirs = models.build_model(args, task)
    load_into_transformer(theirs, transformer_state_dict(ours.state_dict(), args, src.pad(),
                                                         tgt.pad()))
    return ours.eval(), theirs.eval(), src, tgt


def ours_args(overrides):
    """The arguments build_tiny_model(**overrides) builds its model from."""
    return models.MODEL_REGISTRY["annotated_transformer_tiny"].options(Namespace(**overrides))


@pytest.mark.parametrize("config", RUNNABLE_CONFIGS)
def test_exported_transformer_gives_the_same_logits(config):
    ours, theirs, src, tgt = exported_pair(**CONFIGS[config])
    diff, largest = logit_difference(ours, theirs, src, tgt)
    assert diff <= 1e-5 and logits_agree(diff, largest), diff
    # and the check can fail: one perturbed parameter shows
    with torch.no_grad():
        theirs.decoder.layers[-1].fc2.bias[0] += 0.5
    assert not logits_agree(*logit_difference(ours, theirs, src, tgt))


@pytest.mark.parametrize("config", RUNNABLE_CONFIGS)
def test_exported_transformer_decodes_the_same_with_its_incremental_state(config):
    ours, theirs, src, tgt = exported_pair(**CONFIGS[config])
    net_input, _ = sample_batch(src, tgt, batch=4)
    del net_input["prev_output_tokens"]
    outputs = []
    for model in (ours, theirs):
        gen = SequenceGenerator([model], tgt, beam_size=3, max_len_b=15)
        with torch.no_grad():
            hypos = gen.generate([model], {"net_input": net_input})
        outputs.append([(h["tokens"].tolist(), float(h["score"])) for beam in hypos for h in beam])
    assert len(outputs[0]) == len(outputs[1]) == 4 * 3  # every hypothesis of every beam
    assert max(len(tokens) for tokens, _ in outputs[0]) > 2  # more than a word and </s>
    for (a_tokens, a_score), (b_tokens, b_score) in zip(*outputs):
        assert a_tokens == b_tokens
        assert abs(a_score - b_score) < 1e-4


@pytest.mark.parametrize("stored", [torch.float16, torch.bfloat16])
def test_a_checkpoint_saved_in_half_precision_exports_exact_sinusoids(stored):
    """fairseq saves the weights of --fp16 / --bf16 training in that dtype; our model computes its
    sinusoids in full precision whatever the checkpoint holds, and so must the export."""
    src = make_dictionary(40)
    state = {name: p.to(stored) if p.is_floating_point() else p for name, p in
             build_tiny_model(src, src, share_all_embeddings=True).state_dict().items()}
    ours = build_tiny_model(src, src, share_all_embeddings=True)
    ours.load_state_dict(state)
    args = transformer_args(ours_args(dict(share_all_embeddings=True)))
    theirs = models.build_model(args, SimpleNamespace(source_dictionary=src, target_dictionary=src))
    load_into_transformer(theirs, transformer_state_dict(state, args, src.pad(), src.pad()))
    assert logit_difference(ours.eval(), theirs.eval(), src, src)[0] <= 1e-4


def test_a_parameter_without_counterpart_is_refused():
    ours = build_tiny_model()
    state = dict(ours.state_dict())
    state["encoder.extra_gate.weight"] = torch.zeros(3)
    with pytest.raises(PluginError, match="encoder.extra_gate.weight has no counterpart"):
        transformer_state_dict(state, transformer_args(ours_args({})), 1, 1)


def export_cli(*args):
    env = dict(os.environ, PYTHONPATH=REPO)
    env.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)
    return subprocess.run([sys.executable, "-m", "fairseq_plugin.export", *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=600)


@pytest.fixture(scope="module")
def exported(reverse_run, tmp_path_factory):
    w = tmp_path_factory.mktemp("export")
    proc = export_cli(reverse_run["checkpoint"], "--output", w / "transformer.pt",
                      "--ctranslate2", w / "ct2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"checkpoint": w / "transformer.pt", "ct2": w / "ct2", "log": proc.stdout}


def test_export_command_checks_logits_and_writes_a_plain_fairseq_checkpoint(exported):
    assert "same logits as the original (max |diff|" in exported["log"]
    # loadable with weights_only=True (torch >= 2.6's default) in a process without the plugin
    script = ("import sys, torch\n"
              "state = torch.load(sys.argv[1], weights_only=True)\n"
              "model = state['cfg']['model']\n"
              "print(model['arch'], model['encoder_normalize_before'],\n"
              "      'decoder.layers.0.encoder_attn.k_proj.weight' in state['model'])\n")
    proc = subprocess.run([sys.executable, "-c", script, str(exported["checkpoint"])],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["transformer", "True", "True"]


def test_the_export_of_an_eval_bleu_run_loads_with_weights_only_without_the_plugin(
        reverse_run, tmp_path):
    """fairseq-train --eval-bleu saves numpy arrays (its BLEU counts) in the checkpoint's
    metrics; the export leaves the training run's meters behind, so stock torch still loads it."""
    import numpy as np

    state = torch.load(reverse_run["checkpoint"], weights_only=False)
    state["extra_state"]["metrics"] = {"valid": [("_bleu_counts", {"sum": np.array([9, 7])})]}
    with_counts = tmp_path / "checkpoint_eval_bleu.pt"
    torch.save(state, with_counts)
    proc = export_cli(with_counts, "--output", tmp_path / "transformer.pt")
    assert proc.returncode == 0, proc.stderr[-3000:]
    script = ("import sys, torch\n"
              "state = torch.load(sys.argv[1], weights_only=True)\n"
              "print(sorted(state['extra_state']))\n")
    loaded = subprocess.run([sys.executable, "-c", script, str(tmp_path / "transformer.pt")],
                            capture_output=True, text=True)
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    kept = sorted(k for k in state["extra_state"] if k != "metrics")
    assert loaded.stdout.strip() == str(kept)


def test_fairseq_generate_without_the_plugin_translates_like_the_original(
        reverse_run, generated, exported):
    out = cli("fairseq-generate", reverse_run["data_bin"], "--path", exported["checkpoint"],
              "--beam", "5", "--max-tokens", "4096", "--required-batch-size-multiple", "1",
              "--cpu")
    path = exported["checkpoint"].parent / "generate.txt"
    path.write_text(out.stdout)
    theirs = reverse_task.read_generate_output(str(path))
    assert len(theirs) == len(generated) == 500
    assert {i: h for i, (_, _, h) in theirs.items()} == {i: h for i, (_, _, h) in generated.items()}
    # and with the same scores (most hypotheses are right whichever model made them)
    def scores(text):
        return {int(line.split("\t")[0][2:]): float(line.split("\t")[1])
                for line in text.splitlines() if line.startswith("H-")}
    ours = scores((reverse_run["dir"] / "generate.txt").read_text())
    exported_scores = scores(out.stdout)
    assert len(ours) == 500
    assert max(abs(exported_scores[i] - ours[i]) for i in ours) <= 1e-3


def test_ctranslate2_greedy_decoding_equals_fairseq_generate_beam_1(reverse_run, exported):
    import ctranslate2

    out = cli(*reverse_task.generate_command(str(reverse_run["data_bin"]),
                                             str(reverse_run["checkpoint"]), beam=1))
    path = exported["checkpoint"].parent / "generate-beam1.txt"
    path.write_text(out.stdout)
    fairseq_out = reverse_task.read_generate_output(str(path))
    ids = sorted(fairseq_out)
    translator = ctranslate2.Translator(str(exported["ct2"]), device="cpu")
    # fairseq-generate's default --max-len-b 200 is CTranslate2's max_decoding_length
    results = translator.translate_batch([fairseq_out[i][0].split() for i in ids], beam_size=1,
                                         max_decoding_length=200)
    ct2 = [" ".join(r.hypotheses[0]) for r in results]
    assert len(ct2) == 500
    assert ct2 == [fairseq_out[i][2] for i in ids]


def test_exporting_a_checkpoint_of_another_arch_is_refused_in_one_line(exported, tmp_path):
    proc = export_cli(exported["checkpoint"], "--output", tmp_path / "again.pt")
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("annotated-export-fairseq: error: ")
    assert "'transformer' checkpoint, not an annotated_transformer one" in last
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "again.pt").exists()


def test_export_refuses_to_overwrite_without_force_and_a_directory_as_output(
        reverse_run, exported, tmp_path):
    before = exported["checkpoint"].read_bytes()
    proc = export_cli(reverse_run["checkpoint"], "--output", exported["checkpoint"])
    assert proc.returncode != 0
    assert "already exists; choose another output or pass --force" in proc.stderr
    assert exported["checkpoint"].read_bytes() == before
    proc = export_cli(reverse_run["checkpoint"], "--output", tmp_path, "--force")
    assert proc.stderr.strip().splitlines()[-1] == (
        f"annotated-export-fairseq: error: --output {tmp_path} is a directory; give a file name, "
        f"e.g. {tmp_path}/transformer.pt")
    assert os.listdir(tmp_path) == [] and not os.path.exists(f"{tmp_path}.tmp")


def test_force_never_writes_over_the_checkpoint_nor_empties_a_folder_of_other_files(
        reverse_run, exported, tmp_path):
    """--force overwrites an existing --output and an earlier CTranslate2 model; it refuses,
    before anything is written, the checkpoint itself as --output and, as the CTranslate2
    directory, a folder of other files (CTranslate2's own --force would delete it), a file, a
    path under a file, a link, or a folder that would hold --output. (In this process: the
    command's one-line form of these errors is test_errors'.)"""
    import shutil

    from fairseq_plugin.export import export

    original = tmp_path / "checkpoints" / "checkpoint_best.pt"
    original.parent.mkdir()
    shutil.copy(reverse_run["checkpoint"], original)
    before = original.read_bytes()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    a_file = tmp_path / "a_file"
    a_file.write_text("keep me too")
    out = tmp_path / "transformer.pt"
    link = tmp_path / "link"
    link.symlink_to(exported["ct2"])
    itself = (f"--output {original} is one of this command's inputs; give another path "
              f"(inputs are kept)")
    refusals = [
        (original, None, False, itself),  # without --force too: not "pass --force"
        (original, None, True, itself),
        (out, original.parent, True,
         f"--ctranslate2 {original.parent} holds files that are not a CTranslate2 model's (e.g. "
         f"checkpoint_best.pt); --force replaces only an earlier CTranslate2 model: give a new "
         f"directory"),
        (out, mine, True, "(e.g. notes.txt)"),
        (out, a_file, True, f"--ctranslate2 {a_file} is a file; give a directory for the "
                            f"CTranslate2 model"),
        (out, out, True, f"--ctranslate2 {out} would hold --output {out}"),
        (mine / "t.pt", mine, True, "would hold --output"),
        (out, link, True, f"--ctranslate2 {link} is a symbolic link"),
        (out, a_file / "ct2", True, f"{a_file} is a file, not a directory"),
    ]
    for output, ctranslate2, force, message in refusals:
        with pytest.raises(PluginError) as refused:
            export(str(original), str(output), ctranslate2_dir=ctranslate2 and str(ctranslate2),
                   force=force, log=lambda line: None)
        assert message in str(refused.value)
    assert original.read_bytes() == before
    assert sorted(os.listdir(original.parent)) == ["checkpoint_best.pt"]
    assert os.listdir(mine) == ["notes.txt"] and a_file.read_text() == "keep me too"
    assert sorted(os.listdir(tmp_path)) == ["a_file", "checkpoints", "link", "mine"]
    # an earlier export and CTranslate2 model are replaced
    earlier = tmp_path / "ct2"
    shutil.copytree(exported["ct2"], earlier)
    (earlier / "model.bin").write_bytes(b"an earlier model")
    out.write_bytes(b"an earlier export")
    export(str(original), str(out), ctranslate2_dir=str(earlier), force=True,
           log=lambda line: None)
    assert (earlier / "model.bin").read_bytes() == (exported["ct2"] / "model.bin").read_bytes()
    assert torch.load(out, weights_only=True)["cfg"]["model"]["arch"] == "transformer"
    assert sorted(os.listdir(tmp_path)) == ["a_file", "checkpoints", "ct2", "link", "mine",
                                            "transformer.pt"]  # no temporary directory left


def test_a_model_with_short_position_limits_is_compared_within_them():
    """The check's sample sentences stay within --max-source/target-positions (a model of 8 and 6
    positions would otherwise refuse the check's 12-token sentences)."""
    ours, theirs, src, tgt = exported_pair(max_source_positions=8, max_target_positions=6,
                                           encoder_learned_pos=True, decoder_learned_pos=True)
    widths = [(net_input["src_tokens"].size(1), net_input["prev_output_tokens"].size(1))
              for net_input, _ in (sample_batch(src, tgt, seed=seed, max_positions=(8, 6))
                                   for seed in range(10))]
    assert max(w for w, _ in widths) == 8 and max(t for _, t in widths) == 6  # up to the limits
    diff, largest = logit_difference(ours, theirs, src, tgt)
    assert diff <= 1e-4 * largest


def test_the_export_log_names_the_positions_it_wrote(reverse_run, tmp_path):
    """Sinusoids become a learned table; a model without positional encodings gets none."""
    from fairseq_plugin.export import export

    state = torch.load(reverse_run["checkpoint"], weights_only=False)
    state["cfg"]["model"]["no_token_positional_embeddings"] = True  # sinusoids: no parameters
    torch.save(state, tmp_path / "no_positions.pt")
    data_bin = str(reverse_run["data_bin"])
    sharded = os.pathsep.join([data_bin, data_bin])  # fairseq's DIR1:DIR2: the first's dictionaries
    for checkpoint, data, positions in (
            (reverse_run["checkpoint"], data_bin, "learned positions"),
            (tmp_path / "no_positions.pt", sharded, "no positions")):
        lines = []
        export(str(checkpoint), str(tmp_path / "transformer.pt"), data, force=True,
               log=lines.append)
        assert lines[-1].endswith(f"(--arch transformer, pre-LN, {positions})"), lines
        exported_cfg = torch.load(tmp_path / "transformer.pt", weights_only=True)["cfg"]["model"]
        assert exported_cfg["encoder_learned_pos"] == (positions == "learned positions")


def test_options_ctranslate2_does_not_support_are_refused_in_one_line(tmp_path):
    from fairseq_plugin.export import to_ctranslate2

    args = transformer_args(ours_args({"no_token_positional_embeddings": True}))
    args.source_lang, args.target_lang = "src", "tgt"
    exported = {"args": None, "cfg": {"model": {}}, "model": {}}
    with pytest.raises(PluginError, match="CTranslate2 cannot convert this model: .*"
                                          "--no-token-positional-embeddings is not supported.*; "
                                          "drop --ctranslate2 to write only the fairseq export$"):
        to_ctranslate2(exported, str(tmp_path), str(tmp_path / "ct2"), args)
    assert sorted(os.listdir(tmp_path)) == []  # nor a temporary directory left


def test_a_model_ctranslate2_cannot_convert_is_refused_before_the_export_is_written(tmp_path):
    """CTranslate2 needs the same layer-norm placement in both stacks: a checkpoint with a pre-LN
    encoder and a post-LN decoder (tests/data/pre_redesign, made so) writes neither output."""
    from fairseq_plugin.export import export

    here = os.path.join(REPO, "tests", "data", "pre_redesign")
    state = torch.load(os.path.join(here, "checkpoint.pt"), weights_only=False)
    state["cfg"]["model"].decoder_normalize_before = False
    state["model"] = {k: v for k, v in state["model"].items() if not k.startswith("decoder.norm.")}
    state["cfg"]["task"].update(source_lang="src", target_lang="tgt")
    torch.save(state, tmp_path / "mixed.pt")
    with pytest.raises(PluginError, match="CTranslate2 cannot convert this model: .*normalize"):
        export(str(tmp_path / "mixed.pt"), str(tmp_path / "transformer.pt"), here,
               str(tmp_path / "ct2"), log=lambda line: None)
    assert sorted(os.listdir(tmp_path)) == ["mixed.pt"]


def test_an_export_whose_logits_differ_is_refused_and_writes_nothing(reverse_run, tmp_path,
                                                                      monkeypatch):
    from fairseq_plugin import export as export_module

    convert = export_module.transformer_state_dict

    def slightly_wrong(*args, **kwargs):  # a mapping bug: one weight off by 0.01
        mapped = convert(*args, **kwargs)
        name = next(k for k in mapped if k.endswith("layers.0.fc1.weight"))
        mapped[name] = mapped[name] + 0.01
        return mapped

    monkeypatch.setattr(export_module, "transformer_state_dict", slightly_wrong)
    out = tmp_path / "transformer.pt"
    with pytest.raises(PluginError, match=r"logits differ by .* from the original's \(more than "
                                          r"0.0001 x the largest \|logit\|, at least 1: "
                                          r"[\d.e+-]+\)$"):
        export_module.export(str(reverse_run["checkpoint"]), str(out),
                             str(reverse_run["data_bin"]), log=lambda *_: None)
    assert not out.exists()


@pytest.fixture(scope="module")
def post_ln_checkpoint(reverse_run, tmp_path_factory):
    """A few updates of a post-LN model on the reverse task."""
    save = tmp_path_factory.mktemp("post_ln")
    cli(*reverse_task.train_command(str(reverse_run["data_bin"]), str(save), 1,
                                    extra=["--post-norm", "--max-update", "3"]))
    return save / "checkpoint_last.pt"


@pytest.mark.skipif(FAIRSEQ_BREAKS_POST_LN, reason="fairseq 0.12.2 cannot run a post-LN "
                    "transformer loaded from a state dict (#4858); the export refuses it")
def test_a_post_ln_checkpoint_exports_to_fairseqs_default_post_ln(post_ln_checkpoint, tmp_path):
    proc = export_cli(post_ln_checkpoint, "--output", tmp_path / "post.pt")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "same logits as the original" in proc.stdout
    assert "(--arch transformer, post-LN, learned positions)" in proc.stdout


@pytest.mark.skipif(not FAIRSEQ_BREAKS_POST_LN,
                    reason="this fairseq runs post-LN transformers: nothing to refuse")
def test_a_post_ln_export_is_refused_in_one_line_where_fairseq_cannot_run_it(
        post_ln_checkpoint, tmp_path):
    proc = export_cli(post_ln_checkpoint, "--output", tmp_path / "post.pt")
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("annotated-export-fairseq: error: cannot export: fairseq 0.12.2's "
                           "transformer fails on this model (Mask Type should be defined)")
    assert "fairseq #4858" in last and "export a model with a pre-LN encoder" in last
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "post.pt").exists()
