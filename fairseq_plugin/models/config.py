"""The model's options: one typed fairseq dataclass for the command line's flags and the
``model:`` section of a fairseq-hydra-train YAML, how a configuration resolves to every option, and
the checks that refuse, in one line, options a model cannot be built with."""

import argparse
import enum
from argparse import Namespace
from dataclasses import dataclass, field, fields
from typing import Optional

from fairseq import utils
from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from omegaconf import OmegaConf

from ..errors import PluginError, spelling_hint
from ..modules.attention import NO_CUDNN, TORCH_CHOICE
from ..modules.dropout import is_drop_probability

DEFAULT_MAX_POSITIONS = 1024


def _option(default, help):
    return field(default=default, metadata={"help": help})


# --embedding-init: fairseq's transformer's N(0, d_model^-0.5), or the notebook's Glorot uniform
EMBEDDING_INITS = ["normal", "glorot"]
# --linear-init: fairseq's transformer's, or the notebook's Glorot for every linear map
LINEAR_INITS = ["fairseq", "glorot"]


@dataclass
class AnnotatedTransformerConfig(FairseqDataclass):
    """The model's options (``model.*`` in a fairseq-hydra-train YAML, ``--*`` on the command
    line): fairseq ``transformer``'s names and meanings; the defaults are the paper's base model,
    with fairseq's 0.0 for attention_dropout and activation_dropout (the notebook's make_model
    uses its dropout, 0.1, there too: --attention-dropout 0.1 --activation-dropout 0.1)."""

    activation_fn: ChoiceEnum(utils.get_available_activation_fns()) = _option(
        "relu", "activation function of the position-wise feed-forward network")
    dropout: float = _option(0.1, "dropout probability (the paper's P_drop)")
    attention_dropout: float = _option(0.0, "dropout probability on attention weights")
    activation_dropout: float = _option(
        0.0, "dropout probability after the activation in the feed-forward network "
             "(--relu-dropout on the command line too)")
    encoder_embed_dim: int = _option(512, "encoder d_model")
    encoder_ffn_embed_dim: int = _option(2048, "encoder d_ff")
    encoder_layers: int = _option(6, "number of encoder layers (N)")
    encoder_attention_heads: int = _option(8, "encoder attention heads (h)")
    encoder_normalize_before: bool = _option(
        False, "pre-LN in the encoder; as in fairseq, this or decoder_normalize_before makes the "
               "stacks it does not name post-LN (neither: pre-LN in both, see post_norm)")
    encoder_learned_pos: bool = _option(False, "learned instead of sinusoidal positions in the "
                                               "encoder")
    decoder_embed_dim: Optional[int] = _option(None, "decoder d_model (default: encoder_embed_dim)")
    decoder_ffn_embed_dim: Optional[int] = _option(None, "decoder d_ff (default: "
                                                         "encoder_ffn_embed_dim)")
    decoder_layers: int = _option(6, "number of decoder layers (N)")
    decoder_attention_heads: int = _option(8, "decoder attention heads (h)")
    decoder_normalize_before: bool = _option(
        False, "pre-LN in the decoder; as in fairseq, this or encoder_normalize_before makes the "
               "stacks it does not name post-LN (neither: pre-LN in both, see post_norm)")
    decoder_learned_pos: bool = _option(False, "learned instead of sinusoidal positions in the "
                                               "decoder")
    post_norm: bool = _option(
        False, "the paper's post-LN sub-layers, LayerNorm(x + Sublayer(x)), in both stacks "
               "(default: the Annotated Transformer's pre-LN, x + Sublayer(LayerNorm(x)), with a "
               "final LayerNorm)")
    share_decoder_input_output_embed: bool = _option(
        False, "share the decoder input embeddings with the generator (output projection)")
    share_all_embeddings: bool = _option(
        False, "share source, target and output embeddings (needs a joined dictionary: "
               "fairseq-preprocess --joined-dictionary)")
    no_token_positional_embeddings: bool = _option(False, "add no positional encodings")
    no_scale_embedding: bool = _option(False, "do not multiply embeddings by sqrt(d_model)")
    embedding_init: ChoiceEnum(EMBEDDING_INITS) = _option(
        "normal", "token embeddings (and an output projection of their own) drawn from "
                  "N(0, d_model^-0.5), as fairseq's transformer and tensor2tensor draw them, so "
                  "that scaled by sqrt(d_model) they start at the positional encodings' size "
                  "(normal, the default); or Glorot uniform as every other matrix, the notebook's "
                  "make_model (glorot: about 5x smaller at a 6k vocabulary, which learns slower: "
                  "docs/code-map.md)")
    linear_init: ChoiceEnum(LINEAR_INITS) = _option(
        "fairseq", "the linear maps' initialisation: as fairseq's transformer draws them, W^Q, "
                   "W^K, W^V Glorot uniform with gain 1/sqrt(2), W^O's bias 0, torch's default "
                   "for the feed-forward (fairseq, the default: it learned better on real text); "
                   "or Glorot uniform for each matrix, the notebook's make_model (glorot; "
                   "docs/code-map.md)")
    max_source_positions: int = _option(DEFAULT_MAX_POSITIONS, "longest source, in tokens")
    max_target_positions: int = _option(DEFAULT_MAX_POSITIONS, "longest target, in tokens")
    fused_attention_backends: ChoiceEnum([NO_CUDNN, TORCH_CHOICE]) = _option(
        NO_CUDNN, "where the fused attention kernel may run: on any backend but cuDNN, which "
                  "builds a plan for each new shape of its inputs (no-cudnn, the default), or on "
                  "the one torch chooses (torch); the same attention, other kernels (at "
                  "generation: --model-overrides \"{'fused_attention_backends': 'no-cudnn'}\")")
    no_packing: bool = _option(
        False, "in training, run each layer's position-wise work on every position, padding "
               "included (default: on real tokens only where at least 2%% of a batch's positions "
               "are padding, modules/packing.py); the same results, other speed and memory")
    accept_other_dictionaries: bool = _option(
        False, "load a checkpoint whose dictionaries have this data's sizes but other words "
               "(refused otherwise, in one line: a token's index would mean another word; at "
               "generation: --model-overrides \"{'accept_other_dictionaries': True}\")")
    compile_layers: bool = _option(
        False, "compile each encoder and decoder layer with torch.compile (dynamic shapes) for "
               "training and validation; decoding steps stay eager (modules/compiled.py); the "
               "same results, other speed; the first batches of each kind wait for compilation")


class _UnsupportedFlag(argparse.Action):
    """A flag of fairseq's transformer that this model does not implement: refused in one line
    when given (argparse's own refusal, "unrecognized arguments", follows a long usage dump)."""

    def __init__(self, option_strings, dest, nargs=None, **unused):
        super().__init__(option_strings, dest, nargs=nargs, default=argparse.SUPPRESS,
                         help=argparse.SUPPRESS)

    def __call__(self, parser, namespace, values, option_string=None):
        raise PluginError(f"{option_string} is a flag of fairseq's transformer that "
                          f"annotated_transformer does not implement; drop it (the flag table "
                          f"of docs/reference.md lists the flags it has)")


def add_unsupported_transformer_flags(parser) -> None:
    """Hidden, refusing flags for each of fairseq ``transformer``'s flags this parser lacks."""
    from fairseq.models.transformer import TransformerModel

    theirs = argparse.ArgumentParser(add_help=False)
    TransformerModel.add_args(theirs)
    for action in theirs._actions:
        strings = [s for s in action.option_strings if s not in parser._option_string_actions]
        if strings:
            parser.add_argument(*strings, nargs=0 if action.nargs == 0 else None,
                                action=_UnsupportedFlag)


def resolve_options(config, cfg) -> Namespace:
    """Every field of the config class ``config`` (a preset's defaults) with its value in ``cfg``
    (a DictConfig, a config dataclass or an argparse Namespace), or its default."""
    _check_known_options(cfg, config)
    args = Namespace()
    for f in fields(config):
        value = getattr(cfg, f.name, None)
        value = f.default if value is None else value
        # choices as plain strings: the configuration is saved in checkpoints
        setattr(args, f.name, value.value if isinstance(value, enum.Enum) else value)
    if args.decoder_embed_dim is None:
        args.decoder_embed_dim = args.encoder_embed_dim
    if args.decoder_ffn_embed_dim is None:
        args.decoder_ffn_embed_dim = args.encoder_ffn_embed_dim
    return args


def normalize_before(args: Namespace, stack: str) -> bool:
    """Whether the sub-layers of ``stack`` ("encoder" or "decoder") are pre-LN. By default both
    stacks are, as in the Annotated Transformer; --post-norm makes both the paper's post-LN.
    fairseq's --encoder-normalize-before / --decoder-normalize-before, when either is given, keep
    their meaning in fairseq's transformer: pre-LN in the stacks they name, post-LN in the other."""
    if args.post_norm:
        return False
    if args.encoder_normalize_before or args.decoder_normalize_before:
        return getattr(args, f"{stack}_normalize_before")
    return True


def check_options(args: Namespace, src_dict, tgt_dict) -> None:
    """One line for options this model cannot be built with (with these dictionaries)."""
    _check_flags(args)
    if args.share_all_embeddings:
        _check_shared_embeddings(args, src_dict, tgt_dict)
    if getattr(args, "compile_layers", False):
        _check_compiler()


def _check_compiler() -> None:
    """One line where torch.compile cannot run (torch < 2.4 on Python 3.12, for one)."""
    import sys

    import torch
    from torch import _dynamo

    if not _dynamo.is_dynamo_supported():
        raise PluginError(f"--compile-layers: torch.compile does not run with torch "
                          f"{torch.__version__} on Python {sys.version.split()[0]}; drop "
                          f"--compile-layers, or install a torch whose torch.compile supports "
                          f"this Python")


def check_task(task) -> None:
    """One line for task options this model cannot serve: alignment supervision
    (--load-alignments, for label_smoothed_cross_entropy_with_alignment) reads the decoder's
    attention in training, which this model does not return (it skips padding and runs the fused
    kernel there)."""
    if getattr(getattr(task, "cfg", None), "load_alignments", False):
        raise PluginError("--load-alignments: alignment supervision reads the decoder's attention "
                          "weights in training, which annotated_transformer does not return; "
                          "drop --load-alignments, or train fairseq's transformer_align")


def check_heads_divide(d_model: int, heads: int, flag_prefix: str) -> None:
    """One line unless d_k = d_model / h is a whole number."""
    if heads <= 0 or d_model % heads != 0:
        divisor = max((h for h in range(1, max(heads, 1) + 1) if d_model % h == 0), default=1)
        raise PluginError(
            f"--{flag_prefix}-embed-dim {d_model} is not divisible by "
            f"--{flag_prefix}-attention-heads {heads}; choose a number of heads that divides "
            f"the model dimension (e.g. {divisor})")


def _check_flags(args):
    """One line for flags this model cannot be built with."""
    for side in ("encoder", "decoder"):
        n = getattr(args, f"{side}_layers")
        if n < 0:
            raise PluginError(f"--{side}-layers {n} is not a number of layers; use e.g. 6")
    if args.decoder_layers == 0:  # (decoding steps start the caches at layer 0)
        raise PluginError("--decoder-layers 0: the decoder needs at least one layer; use e.g. 6")
    for side in ("encoder", "decoder"):
        check_heads_divide(getattr(args, f"{side}_embed_dim"),
                           getattr(args, f"{side}_attention_heads"), side)
    for flag in ("dropout", "activation_dropout", "attention_dropout"):
        p = getattr(args, flag)
        # attention's dropout is torch's (F.dropout or the fused kernel), not our CPU mask
        if not (0.0 <= p < 1.0 if flag == "attention_dropout" else is_drop_probability(p)):
            bound = "1" if flag == "attention_dropout" else "1 - 2^-16"
            raise PluginError(f"--{flag.replace('_', '-')} {p} is not a probability in "
                              f"[0, {bound}); use e.g. 0.1")
    if args.post_norm and (args.encoder_normalize_before or args.decoder_normalize_before):
        raise PluginError(
            "--post-norm conflicts with --encoder-normalize-before/--decoder-normalize-before; "
            "use --post-norm for the paper's post-LN or drop it for pre-LN")


def _check_shared_embeddings(args, src_dict, tgt_dict):
    if src_dict != tgt_dict:
        raise PluginError(
            "--share-all-embeddings needs a joined dictionary, but the source and target "
            "dictionaries differ; preprocess with fairseq-preprocess --joined-dictionary "
            "or drop --share-all-embeddings")
    if args.encoder_embed_dim != args.decoder_embed_dim:
        raise PluginError(
            f"--share-all-embeddings needs --encoder-embed-dim ({args.encoder_embed_dim}) "
            f"equal to --decoder-embed-dim ({args.decoder_embed_dim})")


def _check_known_options(cfg, config):
    """A model configuration written by hand (a YAML recipe) may only hold the model's options."""
    if not OmegaConf.is_config(cfg):
        return  # argparse Namespaces carry every training option; argparse checks those
    known = {f.name for f in fields(config)}
    unknown = sorted(k for k in cfg.keys() if k not in known)
    if unknown:
        hint = spelling_hint(unknown[0], known, "docs/reference.md")
        raise PluginError(f"unknown model option '{unknown[0]}' (model.{unknown[0]}), not a "
                          f"field of {config.__name__}; {hint}")
