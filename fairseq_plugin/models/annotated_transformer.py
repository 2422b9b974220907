"""The Annotated Transformer as a fairseq encoder-decoder model: ``make_model`` builds the encoder
(encoder.py) and the decoder (decoder.py) from the notebook's pieces (modules/).

"Most competitive neural sequence transduction models have an encoder-decoder structure. Here,
the encoder maps an input sequence of symbol representations (x_1, ..., x_n) to a sequence of
continuous representations z = (z_1, ..., z_n). Given z, the decoder then generates an output
sequence (y_1, ..., y_m) of symbols one element at a time." (Vaswani et al. 2017, section 3)

Tensors are batch-first: B batch, S source length, T target length, d d_model. The options and
their checks are in config.py, the --arch presets in presets.py, which checkpoints fit in
compatibility.py. Where each of the notebook's pieces lives (EncoderDecoder, make_model,
Generator, ...): docs/code-map.md.
"""

import argparse
import collections
from argparse import Namespace
from typing import Optional

import torch
from fairseq import utils
from fairseq.dataclass.utils import gen_parser_from_dataclass
from fairseq.models import ARCH_MODEL_REGISTRY, FairseqEncoderDecoderModel, register_model
from torch import nn

from ..modules.attention import MultiHeadedAttention
from ..modules.compiled import CompiledLayers
from ..modules.embeddings import (
    EmbeddingLayer,
    Embeddings,
    Generator,
    LearnedPositionalEncoding,
    SinusoidalPositionalEncoding,
)
from ..modules.layers import DecoderLayer, EncoderLayer, PositionwiseFeedForward
from .compatibility import FINGERPRINT, check_compatible, check_dictionaries, dictionary_fingerprint
from .config import (AnnotatedTransformerConfig, add_unsupported_transformer_flags, check_options,
                     check_task, normalize_before, resolve_options)
from .decoder import AnnotatedTransformerDecoder
from .encoder import AnnotatedTransformerEncoder

@register_model("annotated_transformer", dataclass=AnnotatedTransformerConfig)
class AnnotatedTransformerModel(FairseqEncoderDecoderModel):
    """The Annotated Transformer (harvardnlp) inside fairseq.

    The notebook's ``EncoderDecoder.forward`` is fairseq's own ``forward``, inherited: the encoder
    on the source (which also makes src_mask), then the decoder on the shifted target, attending to
    the encoder's output (tgt_mask in its ``extract_features``); ``make_model`` builds the pieces.
    Flags keep the names and meanings of fairseq's ``transformer`` wherever the concept is the
    same; the one difference in defaults is pre-LN (the notebook's "norm first") where no
    --*-normalize-before flag is given, see --post-norm.
    """

    @classmethod
    def add_args(cls, parser):
        """One flag per field of this model's config class, with its defaults; fairseq
        transformer's other flags refuse themselves in one line."""
        gen_parser_from_dataclass(parser, getattr(cls, "__dataclass")())
        parser.add_argument("--relu-dropout", dest="activation_dropout", type=float,
                            help=argparse.SUPPRESS)  # fairseq transformer's other name for it
        add_unsupported_transformer_flags(parser)  # refused in one line when given

    @classmethod
    def options(cls, cfg) -> Namespace:
        """Every option of the model ``cfg`` describes (a YAML/command-line DictConfig, a config
        dataclass or an argparse Namespace): its values, this preset's defaults for the rest."""
        return resolve_options(getattr(cls, "__dataclass"), cfg)

    @classmethod
    def build_model(cls, cfg, task):
        """fairseq builds the model here: the options, checked, then make_model."""
        args = cls.options(cfg)
        check_options(args, task.source_dictionary, task.target_dictionary)
        check_task(task)
        return cls.make_model(args, task.source_dictionary, task.target_dictionary)

    @classmethod
    def make_model(cls, args: Namespace, src_dict, tgt_dict) -> "AnnotatedTransformerModel":
        """The notebook's make_model, from fairseq's options: the token embeddings (one module
        when shared), the encoder's and the decoder's N layers, the generator, then the
        initialisation of --embedding-init and --linear-init (fairseq's by default, the
        notebook's Glorot with ``glorot``)."""
        scale = not args.no_scale_embedding
        src_tokens = Embeddings(args.encoder_embed_dim, len(src_dict), src_dict.pad(), scale)
        tgt_tokens = src_tokens if args.share_all_embeddings else Embeddings(
            args.decoder_embed_dim, len(tgt_dict), tgt_dict.pad(), scale)
        share_output = args.share_all_embeddings or args.share_decoder_input_output_embed
        dropout, p_attn = args.dropout, args.attention_dropout
        backends = args.fused_attention_backends  # torch's fused kernel: which backends
        pre_ln = normalize_before(args, "encoder")  # else post-LN, without a final LayerNorm
        d, h = args.encoder_embed_dim, args.encoder_attention_heads
        encoder = AnnotatedTransformerEncoder(
            src_dict,
            embed=_embedding_layer(args, src_tokens, "source"),
            layers=[EncoderLayer(d, MultiHeadedAttention(h, d, p_attn),
                                 _feed_forward(args, d, args.encoder_ffn_embed_dim),
                                 dropout, normalize_before=pre_ln)
                    for _ in range(args.encoder_layers)],
            norm=nn.LayerNorm(d) if pre_ln else None,  # pre-LN's final LayerNorm
            skip_padding=not args.no_packing, attention_backends=backends)
        pre_ln = normalize_before(args, "decoder")
        d, h = args.decoder_embed_dim, args.decoder_attention_heads
        decoder = AnnotatedTransformerDecoder(
            tgt_dict,
            embed=_embedding_layer(args, tgt_tokens, "target"),
            layers=[DecoderLayer(d, MultiHeadedAttention(h, d, p_attn, causal=True),
                                 MultiHeadedAttention(h, d, p_attn, self_attention=False,
                                                      d_memory=args.encoder_embed_dim),
                                 _feed_forward(args, d, args.decoder_ffn_embed_dim),
                                 dropout, normalize_before=pre_ln)
                    for _ in range(args.decoder_layers)],
            norm=nn.LayerNorm(d) if pre_ln else None,
            generator=Generator(d, len(tgt_dict), tgt_tokens.lut.weight if share_output else None),
            skip_padding=not args.no_packing, attention_backends=backends)
        decoder.beam = encoder.beam  # one beam-search state for the model (modules/beam.py)
        model = cls(encoder, decoder)
        # which words the embeddings' rows stand for: a buffer, so checkpoints keep it
        model.register_buffer(FINGERPRINT, dictionary_fingerprint(src_dict, tgt_dict))
        model.accept_other_dictionaries = args.accept_other_dictionaries
        model.init_parameters_(args.embedding_init, args.linear_init)
        if args.compile_layers:
            encoder.compiled = CompiledLayers(encoder.layers)
            decoder.compiled = CompiledLayers(decoder.layers)
        return model

    def load_state_dict(self, state_dict, strict=True, model_cfg=None, args=None):
        """Refuse, in one line, a checkpoint of another architecture or other dictionaries (of
        another size, or of the same size with other words: ``accept_other_dictionaries``
        loads those). A checkpoint from before the fingerprint takes this model's."""
        own = getattr(self, FINGERPRINT)
        saved = state_dict.get(FINGERPRINT)
        if saved is not None and not self.accept_other_dictionaries:
            check_dictionaries(saved.tolist(), own.tolist())
        state_dict = collections.OrderedDict(state_dict)
        state_dict[FINGERPRINT] = own
        check_compatible(self.state_dict(), state_dict, strict)
        return super().load_state_dict(state_dict, strict=strict, model_cfg=model_cfg, args=args)

    def set_beam_size(self, beam_size: int) -> None:
        """fairseq's SequenceGenerator calls this (only for beam > 1, and never to reset it): the
        beam's copies of a sentence then share their keys and values (modules/beam.py)."""
        self.encoder.beam.size = beam_size

    def force_attention_kernel(self, kernel: Optional[str]) -> None:
        """Every attention of the model on one kernel, FUSED or EXPLICIT, or None: the model's
        own choice (MultiHeadedAttention.force_kernel)."""
        for m in self.modules():
            if isinstance(m, MultiHeadedAttention):
                m.force_kernel(kernel)

    def init_parameters_(self, embedding_init: str = "normal", linear_init: str = "fairseq"):
        """make_model's last step, the notebook's: Glorot / fan_avg uniform for every matrix.
        Attention modules initialise their own W^Q, W^K, W^V, W^O (each matrix on its own, also
        where they are stored side by side). Two defaults differ, as fairseq's transformer
        draws them (both learned better on real text: docs/code-map.md): ``embedding_init``
        "normal" (--embedding-init): token embeddings, and an output projection of their own,
        from N(0, d_model^-0.5); ``linear_init`` "fairseq" (--linear-init): the attention's
        linear maps as MultiHeadedAttention.reset_parameters describes, the feed-forward's
        torch's nn.Linear default. "glorot" for either is the notebook's. Padding embeddings
        start at zero (and stay so unless tied to the generator: its log-softmax over every
        type gives the padding row a gradient)."""
        if linear_init == "fairseq":
            for module in self.modules():
                if isinstance(module, MultiHeadedAttention):
                    module.reset_parameters(linear_init)
                elif isinstance(module, PositionwiseFeedForward):
                    for linear in (module.w_1, module.w_2):
                        linear.reset_parameters()  # U(-1/sqrt(fan_in), 1/sqrt(fan_in))
        for name, p in self.named_parameters():  # every other matrix: the notebook's Glorot
            if p.dim() > 1 and not drawn_by_its_module(name, linear_init):
                nn.init.xavier_uniform_(p)
        if embedding_init == "normal":
            for module in self.modules():
                if isinstance(module, (nn.Embedding, Generator)):  # (V, d_model) each
                    weight = getattr(module, "weight", None)
                    weight = module.proj.weight if weight is None else weight
                    nn.init.normal_(weight, mean=0.0, std=weight.size(1) ** -0.5)
        for module in self.modules():
            if isinstance(module, nn.Embedding) and module.padding_idx is not None:
                with torch.no_grad():
                    module.weight[module.padding_idx].zero_()


def _embedding_layer(args, tokens: Embeddings, side: str) -> EmbeddingLayer:
    """The notebook's src_embed / tgt_embed: token embeddings, positional encodings (sinusoidal,
    learned or none), dropout on their sum."""
    stack = "encoder" if side == "source" else "decoder"
    max_positions = getattr(args, f"max_{side}_positions")
    positional = None
    if not args.no_token_positional_embeddings:
        learned = getattr(args, f"{stack}_learned_pos")
        encoding = LearnedPositionalEncoding if learned else SinusoidalPositionalEncoding
        positional = encoding(getattr(args, f"{stack}_embed_dim"), max_positions)
    return EmbeddingLayer(tokens, positional, args.dropout, side=side, max_positions=max_positions)


def _feed_forward(args, d_model: int, d_ff: int) -> PositionwiseFeedForward:
    return PositionwiseFeedForward(
        d_model, d_ff, utils.get_activation_fn(args.activation_fn), args.activation_dropout)


def drawn_by_its_module(name: str, linear_init: str) -> bool:
    """Whether init_parameters_ leaves the parameter ``name`` to its module's own rule: the
    attention's (MultiHeadedAttention.reset_parameters, each of W^Q, W^K, W^V, W^O on its own),
    and with --linear-init fairseq the feed-forward's (torch's nn.Linear default)."""
    parts = name.split(".")
    return ("self_attn" in parts or "src_attn" in parts
            or (linear_init == "fairseq" and "feed_forward" in parts))


def resolved_model_config(model_cfg) -> Optional[Namespace]:
    """Every option of the annotated_transformer a model configuration builds, or None when it
    is not an annotated_transformer configuration."""
    arch = getattr(model_cfg, "_name", None) or getattr(model_cfg, "arch", None)
    model = ARCH_MODEL_REGISTRY.get(arch)
    if model is None or not issubclass(model, AnnotatedTransformerModel):
        return None
    return model.options(model_cfg)
