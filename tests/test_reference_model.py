"""The fairseq model is the notebook's model: the plain EncoderDecoder of reference.py, with the
same weights (reference_weights.py), gives the same log-probabilities on a padded batch and the
same greedy translations, whichever way the weights go."""

import os

import pytest
import torch

from fairseq_plugin import reference
from fairseq_plugin.errors import PluginError
from fairseq_plugin.reference_weights import (load_plain_weights, plain_model,
                                              plain_model_from_checkpoint, plain_name_of,
                                              right_padded)
from conftest import build_tiny_model, make_dictionary, padded_batch

TOLERANCE = 1e-5  # fp32
PRE_REDESIGN = os.path.join(os.path.dirname(__file__), "data", "pre_redesign")


def fairseq_batch(src_dict, tgt_dict, seed=0):
    """Three sentences, padded as fairseq pads them (conftest.padded_batch): src, lengths, prev."""
    g = torch.Generator().manual_seed(seed)
    return padded_batch(src_dict, (7, 4, 6), (5, 6, 3), tgt_dict, g)[:3]


def fairseq_log_probs(model, src, lengths, prev):
    with torch.no_grad():
        out = model(src, lengths, prev)
        return model.get_normalized_probs(out, log_probs=True)


def plain_log_probs(plain, src, prev, src_pad, tgt_pad):
    """The notebook's forward on the same batch, padded on the right as the notebook pads."""
    src = right_padded(src, src_pad)
    with torch.no_grad():
        out = plain(src, prev, reference.src_mask_of(src, src_pad),
                    reference.tgt_mask_of(prev, tgt_pad))
        return plain.generator(out)


def max_difference_at_real_targets(model, plain, src_dict, tgt_dict):
    src, lengths, prev = fairseq_batch(src_dict, tgt_dict)
    expected = plain_log_probs(plain, src, prev, src_dict.pad(), tgt_dict.pad())
    got = fairseq_log_probs(model, src, lengths, prev)
    real = prev.ne(tgt_dict.pad())
    return (got - expected)[real].abs().max().item()


CONFIGS = {
    "pre-LN (the notebook's)": {},
    "post-LN (the paper's)": {"post_norm": True},
    "pre-LN encoder, post-LN decoder": {"encoder_normalize_before": True},
    "all embeddings shared": {"share_all_embeddings": True},
    "decoder input and output shared": {"share_decoder_input_output_embed": True},
    "3+1 layers, other widths": {"encoder_layers": 3, "decoder_layers": 1,
                                 "encoder_ffn_embed_dim": 96, "decoder_attention_heads": 2},
}


@pytest.mark.parametrize("overrides", CONFIGS.values(), ids=CONFIGS.keys())
def test_the_plain_model_with_the_fairseq_models_weights_gives_its_log_probabilities(overrides):
    src_dict = make_dictionary(40)
    tgt_dict = src_dict if overrides.get("share_all_embeddings") else make_dictionary(33)
    model = build_tiny_model(src_dict, tgt_dict, **overrides)
    plain = plain_model(model)
    assert max_difference_at_real_targets(model, plain, src_dict, tgt_dict) < TOLERANCE


def test_a_preset_other_than_tiny_is_the_plain_model_too():
    from types import SimpleNamespace
    from argparse import Namespace
    from fairseq.models import MODEL_REGISTRY

    d = make_dictionary(30)
    task = SimpleNamespace(source_dictionary=d, target_dictionary=d)
    model = MODEL_REGISTRY["annotated_transformer_iwslt_de_en"].build_model(
        Namespace(encoder_layers=1, decoder_layers=1), task).eval()
    assert max_difference_at_real_targets(model, plain_model(model), d, d) < TOLERANCE


def greedy_fairseq(model, src, lengths, steps):
    """The fairseq model's greedy decoding over its incremental cache: encode once, then one
    decoder step per token, the most probable next token appended."""
    with torch.no_grad():
        encoder_out, state = model.encoder(src, lengths), {}
        ys = torch.full((src.size(0), 1), model.decoder.dictionary.eos())
        for _ in range(steps):
            logits = model.decoder(ys, encoder_out=encoder_out, incremental_state=state)[0]
            ys = torch.cat([ys, logits[:, -1].argmax(-1, keepdim=True)], 1)
    return ys[:, 1:]


def greedy_plain(plain, src, pad, eos, steps):
    src = right_padded(src, pad)
    ys = reference.greedy_decode(plain, src, reference.src_mask_of(src, pad), steps + 1, eos)
    return ys[:, 1:]


def test_make_models_weights_in_the_fairseq_model_give_the_same_log_probs_and_greedy_output():
    """A model the notebook's make_model initialised, loaded into the fairseq model."""
    src_dict, tgt_dict = make_dictionary(40), make_dictionary(36)
    torch.manual_seed(0)
    plain = reference.make_model(len(src_dict), len(tgt_dict), N=2, d_model=64, d_ff=256,
                                 h=4).eval()
    with torch.no_grad():
        plain.generator.proj.weight.mul_(4.0)  # sharper: greedy's choices not near-ties
    model = build_tiny_model(src_dict, tgt_dict)
    load_plain_weights(model, plain)
    assert max_difference_at_real_targets(model, plain, src_dict, tgt_dict) < TOLERANCE

    src, lengths, _ = fairseq_batch(src_dict, tgt_dict)
    expected = greedy_plain(plain, src, src_dict.pad(), tgt_dict.eos(), 6)
    assert torch.equal(greedy_fairseq(model, src, lengths, 6), expected)
    assert len(set(map(tuple, expected.tolist()))) > 1  # not one answer for every source


def test_a_checkpoint_loads_into_the_plain_model():
    """The checkpoint written before the readable-core redesign (separate dictionaries), read
    with fairseq's own loader."""
    from fairseq import checkpoint_utils

    path = os.path.join(PRE_REDESIGN, "checkpoint.pt")
    overrides = {"data": PRE_REDESIGN, "source_lang": "src", "target_lang": "tgt"}
    (model,), _, task = checkpoint_utils.load_model_ensemble_and_task([path],
                                                                      arg_overrides=overrides)
    model.eval()
    plain = plain_model_from_checkpoint(path, overrides)
    src_dict, tgt_dict = task.source_dictionary, task.target_dictionary
    assert max_difference_at_real_targets(model, plain, src_dict, tgt_dict) < TOLERANCE
    src, lengths, _ = fairseq_batch(src_dict, tgt_dict, seed=1)
    assert torch.equal(greedy_fairseq(model, src, lengths, 5),
                       greedy_plain(plain, src, src_dict.pad(), tgt_dict.eos(), 5))


def test_fused_projections_split_in_the_order_of_their_rows():
    assert plain_name_of("encoder.layers.0.self_attn.qkv_proj.weight") == [
        "encoder.layers.0.self_attn.w_q.weight", "encoder.layers.0.self_attn.w_k.weight",
        "encoder.layers.0.self_attn.w_v.weight"]
    assert plain_name_of("decoder.layers.1.src_attn.kv_proj.bias") == [
        "decoder.layers.1.src_attn.w_k.bias", "decoder.layers.1.src_attn.w_v.bias"]
    assert plain_name_of("decoder.norm.weight") == ["decoder.norm.weight"]


def test_what_the_notebooks_model_lacks_is_refused_in_one_line():
    d = make_dictionary(30)
    with pytest.raises(PluginError, match="no positions other than sinusoids"):
        plain_model(build_tiny_model(d, encoder_learned_pos=True))
    with pytest.raises(PluginError, match="no an activation other than relu|activation"):
        plain_model(build_tiny_model(d, activation_fn="gelu"))
    shared = build_tiny_model(d, share_all_embeddings=True)
    plain = reference.make_model(len(d), len(d), N=2, d_model=64, d_ff=256, h=4)
    with pytest.raises(PluginError, match="ties .* different matrices"):
        load_plain_weights(shared, plain)


def test_right_padding_keeps_each_rows_tokens_in_order():
    src = torch.tensor([[1, 1, 5, 6, 2], [7, 8, 9, 4, 2]])
    assert right_padded(src, 1).tolist() == [[5, 6, 2, 1, 1], [7, 8, 9, 4, 2]]
