"""--compile-layers (modules/compiled.py): the layers compiled with torch.compile compute what the
eager layers compute, in one graph per layer, with few recompiles over fairseq's batches."""

import gzip
import inspect
import json
import os
import re

import pytest
import torch

from fairseq_plugin.modules import layers
from conftest import REPO, build_tiny_model, cli, make_dictionary, padded_batch, random_tokens

TATOEBA = os.path.join(REPO, "examples", "tatoeba", "data")
# what an epoch of fairseq's batches may recompile, per layer forward (EncoderLayer,
# DecoderLayer), beyond its first compilation; torch's own limit (then it runs eager) is 8
RECOMPILE_BOUND = {"EncoderLayer": 4, "DecoderLayer": 5}


# a third of the sources and half the targets shorter
SRC_LENGTHS, TGT_LENGTHS = (5, 5, 9, 9, 9, 9), (7, 7, 7, 4, 4, 4)


def loss_and_gradients(model, src, prev, tgt, pad):
    """The target's summed NLL (fp32) and every parameter's gradient."""
    model.zero_grad()
    logits = model(src, src.ne(pad).sum(1), prev)[0]
    lprobs = logits.float().log_softmax(-1)
    loss = -lprobs.gather(-1, tgt.unsqueeze(-1)).squeeze(-1).masked_fill(tgt.eq(pad), 0).sum()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                           if p.grad is not None}


@pytest.mark.parametrize("post_norm, packing", [
    pytest.param(False, True, id="pre-LN-packing"),  # (the fairseq 0.12.2 lane: this one)
    pytest.param(False, False, id="pre-LN-no-packing", marks=pytest.mark.main_lane),
    pytest.param(True, True, id="post-LN-packing", marks=pytest.mark.main_lane),
    pytest.param(True, False, id="post-LN-no-packing", marks=pytest.mark.main_lane)])
def test_compiled_layers_give_the_eager_loss_and_every_gradient(post_norm, packing):
    """fp32, dropout 0, a padded training batch: the same loss and gradients (within 1e-5), from
    layers torch.compile did compile (its frame counter moved), without a graph break."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    d = make_dictionary(40)
    flags = dict(dropout=0.0, post_norm=post_norm, no_packing=not packing)
    eager = build_tiny_model(d, **flags).train()
    compiled = build_tiny_model(d, compile_layers=True, **flags).train()
    compiled.load_state_dict(eager.state_dict())
    assert eager.encoder.compiled is None and len(compiled.encoder.compiled) == 2
    src, _, prev, tgt = padded_batch(d, SRC_LENGTHS, TGT_LENGTHS)
    expected_loss, expected = loss_and_gradients(eager, src, prev, tgt, d.pad())
    loss, grads = loss_and_gradients(compiled, src, prev, tgt, d.pad())
    assert counters["stats"]["unique_graphs"] >= 2  # an encoder and a decoder layer's graphs
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert abs(loss - expected_loss) <= 1e-5 * abs(expected_loss)
    assert grads.keys() == expected.keys() and len(grads) == len(list(eager.parameters()))
    for name, grad in expected.items():
        assert (grads[name] - grad).abs().max() <= 1e-5 * max(1.0, grad.abs().max()), name


def test_decoding_steps_stay_eager():
    """Beam search's steps (incremental_state) run the layers uncompiled: nothing is compiled
    by a decoding step, and the step's output is the eager model's."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    d = make_dictionary(40)
    eager, compiled = build_tiny_model(d), build_tiny_model(d, compile_layers=True)
    compiled.load_state_dict(eager.state_dict())
    src = random_tokens(d, 2, 6)
    out = {}
    for name, model in (("eager", eager), ("compiled", compiled)):
        encoder_out = model.encoder(src, torch.full((2,), 6))
        frames = counters["stats"]["unique_graphs"]
        prev = torch.full((2, 1), d.eos())
        out[name] = model.decoder(prev, encoder_out, incremental_state={})[0]
        assert counters["stats"]["unique_graphs"] == frames, name
    assert torch.allclose(out["eager"], out["compiled"], atol=1e-5)


def tatoeba_words(dest, pairs=None):
    """The bundled Tatoeba sample as words (split on spaces, no BPE: 8,000 types a side, the rest
    <unk>), binarised by fairseq-preprocess: real sentence lengths, fast to prepare."""
    raw = dest / "raw"
    raw.mkdir(parents=True)
    for split in ("train", "valid"):
        for lang in ("de", "en"):
            with gzip.open(os.path.join(TATOEBA, f"{split}.{lang}.gz"), "rt") as f:
                lines = f.read().splitlines()[:pairs]
            (raw / f"{split}.{lang}").write_text("\n".join(lines) + "\n")
    cli("fairseq-preprocess", "--source-lang", "de", "--target-lang", "en",
        "--trainpref", raw / "train", "--validpref", raw / "valid", "--destdir", dest / "bin",
        "--nwordssrc", 8000, "--nwordstgt", 8000, "--workers", 2)
    return dest / "bin"


def train(data_bin, save, *extra):
    """One epoch of the tiny preset on the CPU, dropout 0; (json log lines, the full log)."""
    env = {**os.environ, "TORCH_LOGS": "recompiles,graph_breaks", "PYTHONUNBUFFERED": "1"}
    proc = cli("fairseq-train", data_bin, "--user-dir", os.path.join(REPO, "fairseq_plugin"),
               "--arch", "annotated_transformer_tiny", "--dropout", "0", "--optimizer", "adam",
               "--lr", "1e-3", "--max-tokens", "2048", "--max-epoch", "1", "--seed", "1", "--cpu",
               "--log-format", "json", "--log-interval", "5", "--save-dir", save, "--no-save",
               "--num-workers", "0", *extra, env=env, timeout=1200)
    log = proc.stdout + proc.stderr
    stats = [json.loads(line[line.index("{"):]) for line in log.splitlines()
             if "| INFO | train_inner |" in line or "| INFO | valid |" in line]
    return stats, log


@pytest.mark.main_lane
def test_an_epoch_of_tatoeba_trains_the_same_compiled_with_few_recompiles(tmp_path):
    """fairseq-train over one epoch of the Tatoeba sample's first 8,000 pairs (about 40 batches
    of fairseq's variable shapes, training then validation; each further batch shape adds no
    compilation, so the whole sample's 60,000 would add time, not evidence): the logged losses of
    the compiled layers follow the eager ones (fp32 sums in another order: within 0.2 %), no
    graph breaks, and each layer's forward recompiles at most RECOMPILE_BOUND times."""
    data_bin = tatoeba_words(tmp_path, pairs=8000)
    eager, _ = train(data_bin, tmp_path / "eager")
    compiled, log = train(data_bin, tmp_path / "compiled", "--compile-layers")
    assert len(compiled) == len(eager) >= 4
    for ours, theirs in zip(compiled, eager):
        key = "loss" if "loss" in theirs else "valid_loss"
        assert float(ours[key]) == pytest.approx(float(theirs[key]), rel=2e-3), (ours, theirs)
    assert "Graph break" not in log
    # (at least one each: training's graph, then validation's without gradients)
    recompiles = re.findall(r"Recompiling function forward in \S*modules/layers\.py:(\d+)", log)
    for layer, bound in RECOMPILE_BOUND.items():
        line = inspect.getsourcelines(getattr(layers, layer).forward)[1]
        assert 0 < recompiles.count(str(line)) <= bound, (layer, line, recompiles)


def test_where_torch_compile_cannot_run_the_flag_is_refused_in_one_line(monkeypatch):
    from torch import _dynamo

    from fairseq_plugin.errors import PluginError

    monkeypatch.setattr(_dynamo, "is_dynamo_supported", lambda: False)
    with pytest.raises(PluginError, match=r"^--compile-layers: torch.compile does not run with "
                                          r"torch .* on Python .*; drop --compile-layers"):
        build_tiny_model(make_dictionary(40), compile_layers=True)
    assert build_tiny_model(make_dictionary(40)).encoder.compiled is None  # without the flag
