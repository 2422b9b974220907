"""Weights between the plain notebook model (reference.py) and the fairseq model.

``plain_model(fairseq_model)`` builds the notebook's ``EncoderDecoder`` of the same sizes and
copies the fairseq model's weights into it; ``plain_model_from_checkpoint(path)`` does it for an
``annotated_transformer`` checkpoint; ``load_plain_weights(fairseq_model, plain)`` goes the other
way. The two models then compute the same log-probabilities (the tests' oracle).

The parameter names are the notebook's in both, but for three things the fairseq model does for
speed or for fairseq: W^Q, W^K, W^V stored side by side (``qkv_proj``; ``q_proj`` and
``kv_proj`` in source attention), W^O named ``out_proj``, and the embeddings and generator
inside the encoder and decoder. ``plain_name_of`` says where each fairseq parameter goes.
"""

import math
import re
from typing import Dict, List, Tuple

import torch
from torch import Tensor, nn

from . import reference
from .errors import PluginError
from .modules.embeddings import SinusoidalPositionalEncoding

# fairseq model's name -> the plain model's names (several: the rows are split among them)
RENAMES = [
    (r"^encoder\.embed\.embeddings\.lut\.", ["src_embed.0.lut."]),
    (r"^decoder\.embed\.embeddings\.lut\.", ["tgt_embed.0.lut."]),
    (r"^decoder\.generator\.", ["generator."]),
    (r"(^|\.)qkv_proj\.", [r"\1w_q.", r"\1w_k.", r"\1w_v."]),
    (r"(^|\.)q_proj\.", [r"\1w_q."]),
    (r"(^|\.)kv_proj\.", [r"\1w_k.", r"\1w_v."]),
    (r"(^|\.)out_proj\.", [r"\1w_o."]),
]


def plain_name_of(name: str) -> List[str]:
    """The plain model's parameter names for a fairseq model's parameter ``name``: one, or the
    three (two) W^Q, W^K, W^V stored side by side in it, in their order of rows."""
    for pattern, replacements in RENAMES:
        if re.search(pattern, name):
            return [re.sub(pattern, r, name) for r in replacements]
    return [name]


def _sizes(model) -> Tuple[dict, dict]:
    """The plain model's sizes, per stack, from a fairseq AnnotatedTransformerModel; what the
    notebook's model does not have is refused in one line."""
    stacks = {}
    for side, stack in (("encoder", model.encoder), ("decoder", model.decoder)):
        layer = stack.layers[0]
        embed = stack.embed
        d = embed.embeddings.lut.embedding_dim
        refuse = [what for what, lacks in (
            ("positions other than sinusoids", not isinstance(embed.positional,
                                                              SinusoidalPositionalEncoding)),
            ("--no-scale-embedding", embed.embeddings.factor != math.sqrt(d)),
            ("an activation other than relu",
             layer.feed_forward.activation is not torch.nn.functional.relu),
        ) if lacks]
        if refuse:
            raise PluginError(f"the plain notebook model has no {refuse[0]} (the {side} has); "
                              f"train without it to compare with reference.py")
        stacks[side] = dict(N=len(stack.layers), d_model=d, h=layer.self_attn.h,
                            d_ff=layer.feed_forward.w_1.out_features,
                            pre_ln=stack.norm is not None, max_len=embed.max_positions + 1,
                            vocab=embed.embeddings.lut.num_embeddings)
    return stacks["encoder"], stacks["decoder"]


def build_plain(enc: dict, dec: dict) -> reference.EncoderDecoder:
    """The notebook's make_model with a size per stack (no dropout: compare in eval mode)."""
    def mha(s, d_memory=None):
        return reference.MultiHeadedAttention(s["h"], s["d_model"], d_memory=d_memory)

    def ff(s):
        return reference.PositionwiseFeedForward(s["d_model"], s["d_ff"], 0.0)

    encoder_layer = reference.EncoderLayer(enc["d_model"], mha(enc), ff(enc), 0.0, enc["pre_ln"])
    decoder_layer = reference.DecoderLayer(dec["d_model"], mha(dec), mha(dec, enc["d_model"]),
                                           ff(dec), 0.0, dec["pre_ln"])
    return reference.EncoderDecoder(
        reference.Encoder(encoder_layer, enc["N"], enc["pre_ln"]),
        reference.Decoder(decoder_layer, dec["N"], dec["pre_ln"]),
        nn.Sequential(reference.Embeddings(enc["d_model"], enc["vocab"]),
                      reference.PositionalEncoding(enc["d_model"], 0.0, enc["max_len"])),
        nn.Sequential(reference.Embeddings(dec["d_model"], dec["vocab"]),
                      reference.PositionalEncoding(dec["d_model"], 0.0, dec["max_len"])),
        reference.Generator(dec["d_model"], dec["vocab"]))


def plain_state_dict(fairseq_state: Dict[str, Tensor]) -> Dict[str, Tensor]:
    """A fairseq model's state dict under the plain model's names."""
    plain = {}
    for name, tensor in fairseq_state.items():
        if name == "dictionary_fingerprint":  # not a weight (the model's buffer)
            continue
        names = plain_name_of(name)
        for plain_name, part in zip(names, tensor.chunk(len(names))):
            plain[plain_name] = part
    return plain


@torch.no_grad()
def plain_attention(attn) -> reference.MultiHeadedAttention:
    """The notebook's MultiHeadedAttention (four separate matrices) with the weights of the
    fairseq model's ``modules.attention.MultiHeadedAttention``."""
    d_memory = None if attn.self_attention else attn.kv_proj.in_features
    plain = reference.MultiHeadedAttention(attn.h, attn.h * attn.d_k, d_memory=d_memory)
    plain.load_state_dict(plain_state_dict(attn.state_dict()))
    return plain.to(attn.out_proj.weight)


@torch.no_grad()
def plain_model(model) -> reference.EncoderDecoder:
    """The notebook's model with the weights of a fairseq AnnotatedTransformerModel, in eval mode
    (shared embeddings become equal copies)."""
    plain = build_plain(*_sizes(model))
    plain.load_state_dict(plain_state_dict(model.state_dict()))
    return plain.to(next(model.parameters())).eval()


@torch.no_grad()
def load_plain_weights(model, plain: reference.EncoderDecoder) -> None:
    """Put a plain model's weights (e.g. from reference.make_model) into a fairseq model of the
    same sizes. Where the fairseq model ties matrices (shared embeddings), the plain model's
    copies must be equal."""
    plain_state = plain.state_dict()
    state = {}
    for name, tensor in model.state_dict().items():
        if name == "dictionary_fingerprint":  # the model's own, not a weight (make_model)
            state[name] = tensor
            continue
        parts = [plain_state[n] for n in plain_name_of(name)]
        state[name] = torch.cat(parts) if len(parts) > 1 else parts[0]
    tied = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        tied.setdefault(id(p), []).append(name)
    for names in tied.values():
        if any(not torch.equal(state[names[0]], state[n]) for n in names[1:]):
            raise PluginError(f"the fairseq model ties {' and '.join(names)}, but the plain "
                              f"model's are different matrices; build the fairseq model "
                              f"without shared embeddings")
    model.load_state_dict(state)


def plain_model_from_checkpoint(path: str, arg_overrides: dict = None) -> reference.EncoderDecoder:
    """The notebook's model with the weights of an annotated_transformer checkpoint (any preset,
    pre- or post-LN, shared or separate embeddings), read with fairseq's own loader;
    ``arg_overrides`` as fairseq's (e.g. the data-bin with the dictionaries: {"data": DIR})."""
    from fairseq import checkpoint_utils

    models, _ = checkpoint_utils.load_model_ensemble([path], arg_overrides=arg_overrides)
    return plain_model(models[0])


def right_padded(tokens: Tensor, pad: int) -> Tensor:
    """A fairseq batch (B, L), left-padded as fairseq pads sources, padded on the right as the
    notebook's batches are: each row's real tokens moved to its start."""
    real = tokens.ne(pad)
    order = torch.sort((~real).int(), dim=1, stable=True).indices  # real tokens first, in order
    return tokens.gather(1, order)
