"""The Annotated Transformer as a fairseq encoder-decoder model, and its arch presets.

"Most competitive neural sequence transduction models have an encoder-decoder structure. Here,
the encoder maps an input sequence of symbol representations (x_1, ..., x_n) to a sequence of
continuous representations z = (z_1, ..., z_n). Given z, the decoder then generates an output
sequence (y_1, ..., y_m) of symbols one element at a time." (Vaswani et al. 2017, section 3)

Tensors are batch-first: B batch, S source length, T target length, d d_model. The options and
their checks are in config.py. Where each of the notebook's pieces lives (EncoderDecoder,
make_model, Generator, ...): docs/code-map.md.
"""

import argparse
import collections
from argparse import Namespace
from dataclasses import field, fields, make_dataclass
from typing import Dict, List, Optional, Tuple

import torch
from fairseq import utils
from fairseq.dataclass.utils import gen_parser_from_dataclass
from fairseq.models import (
    ARCH_MODEL_REGISTRY,
    FairseqEncoder,
    FairseqEncoderDecoderModel,
    FairseqIncrementalDecoder,
    register_model,
)
from torch import Tensor, nn

from ..errors import PluginError
from ..modules.attention import (NO_CUDNN, IncrementalState, MultiHeadedAttention,
                                 check_backends, fused_backends)
from ..modules.cache import Ancestry, ReorderPlans, beam_group, reorder_encoder_rows
from ..modules.compiled import CompiledLayers
from ..modules.embeddings import (
    EmbeddingLayer,
    Embeddings,
    Generator,
    LearnedPositionalEncoding,
    SinusoidalPositionalEncoding,
)
from ..modules.layers import DecoderLayer, EncoderLayer, PositionwiseFeedForward
from ..modules.packing import packing_for
from .config import (AnnotatedTransformerConfig, add_unsupported_transformer_flags,
                     check_dictionaries, check_options, check_task, dictionary_fingerprint,
                     dictionary_size_error, normalize_before, resolve_options)


class AnnotatedTransformerEncoder(FairseqEncoder):
    """"The encoder is composed of a stack of N = 6 identical layers." (section 3.1) Built by
    ``AnnotatedTransformerModel.make_model``."""

    def __init__(self, dictionary, embed: EmbeddingLayer, layers: List[EncoderLayer],
                 norm: Optional[nn.LayerNorm], skip_padding: bool = True,
                 attention_backends: str = NO_CUDNN):
        super().__init__(dictionary)
        self.padding_idx = dictionary.pad()
        self.embed = embed  # the notebook's src_embed: Embeddings and PositionalEncoding
        self.layers = nn.ModuleList(layers)
        self.norm = norm  # pre-LN's final LayerNorm (None when post-LN)
        # in training, position-wise work on real tokens only (packing.py; off: --no-packing)
        self.skip_padding = skip_padding
        # --compile-layers: the layers compiled for full passes (modules/compiled.py), or None
        self.compiled: Optional[CompiledLayers] = None
        # --fused-attention-backends: where torch's fused attention may run, during the layers
        self.attention_backends = check_backends(attention_backends)
        self.beam_size = 1  # set by fairseq's SequenceGenerator, through the model
        # beam search's reorder plans, shared with the decoder (make_model; modules/cache.py)
        self.reorder_plans = ReorderPlans()

    def forward(self, src_tokens: Tensor, src_lengths: Optional[Tensor] = None,
                return_all_hiddens: bool = False, **unused):
        """src_tokens (B, S) -> {"encoder_out": [(B, S, d)], "encoder_padding_mask": [(B, S)],
        "src_mask": [(B, 1, 1, S)] or [] when nothing is padded, ...}"""
        padding_mask = src_tokens.eq(self.padding_idx)  # (B, S), True at padding
        padded = int(padding_mask.sum())  # the one value read back from the device (a GPU waits)
        # the notebook's src_mask, True at real tokens, made once for the encoder and the decoder
        mask = ~padding_mask[:, None, None, :] if padded else None  # (B, 1, 1, S)
        x = self.embed(src_tokens)  # (B, S, d)
        states = [x] if return_all_hiddens else []
        # in training, position-wise work on real tokens only (modules/packing.py)
        packing = packing_for(padding_mask, padded, self.skip_padding and self.training)
        x = packing.pack(x)
        with fused_backends(self.attention_backends, x.device):
            for layer in self.compiled or self.layers:
                x = layer(x, mask, packing)
                if return_all_hiddens:
                    states.append(packing.unpack(x))
        x = packing.unpack(x)
        if self.norm is not None:
            x = self.norm(x)
        return {
            "encoder_out": [x],  # (B, S, d): batch-first, unlike fairseq's transformer
            "encoder_padding_mask": [padding_mask],
            "src_mask": [mask] if mask is not None else [],
            "encoder_states": states,
            "src_lengths": [src_lengths] if src_lengths is not None else [],
            "beam_group": [],  # modules/cache.py: reorder_encoder_rows
        }

    @torch.jit.unused
    def reorder_encoder_out(self, encoder_out: Dict[str, List[Tensor]], new_order: Tensor):
        """Row i of the result is row new_order[i] of encoder_out; beam search's beam_size copies
        of a sentence are not copied again at every step (modules/cache.py)."""
        return reorder_encoder_rows(encoder_out, self.reorder_plans.reorder(new_order),
                                    self.beam_size)

    def max_positions(self) -> int:
        return self.embed.max_positions


def source_mask(encoder_out: Dict[str, List[Tensor]]) -> Optional[Tensor]:
    """The encoder's src_mask (B, 1, 1, S), True at real tokens; None when nothing is padded."""
    mask = encoder_out["src_mask"]
    return mask[0] if mask else None


def count_padding(padding: Tensor) -> Tuple[int, bool]:
    """How many positions of a (B, T) padding mask (True at padding) are padding, and whether a
    row has padding before a real token (left padding), read back from the device at once: each
    read makes the host wait until a GPU has finished the work queued before it."""
    padded, left = torch.stack([padding.sum(), (padding[:, :-1] & ~padding[:, 1:]).sum()]).tolist()
    return padded, left > 0


def average_heads(attn: Optional[Tensor], heads: Optional[int]) -> Optional[Tensor]:
    """fairseq's alignment: the source attention (B, h, T, S) averaged over its first ``heads``
    heads (all when None) -> (B, T, S)."""
    if attn is None:
        return None
    return (attn if heads is None else attn[:, :heads]).mean(dim=1)


class AnnotatedTransformerDecoder(FairseqIncrementalDecoder):
    """"The decoder is also composed of a stack of N = 6 identical layers." (section 3.1) Built by
    ``AnnotatedTransformerModel.make_model``.

    With fairseq's ``incremental_state`` it decodes one token per call, reusing the keys and
    values its attention modules cache (modules/cache.py), as beam search does; without it, it
    runs teacher-forced over the whole prefix.
    """

    def __init__(self, dictionary, embed: EmbeddingLayer, layers: List[DecoderLayer],
                 norm: Optional[nn.LayerNorm], generator: Generator, skip_padding: bool = True,
                 attention_backends: str = NO_CUDNN,
                 reorder_plans: Optional[ReorderPlans] = None):
        super().__init__(dictionary)
        self.padding_idx = dictionary.pad()
        self.embed = embed  # the notebook's tgt_embed: Embeddings and PositionalEncoding
        self.layers = nn.ModuleList(layers)
        self.norm = norm  # pre-LN's final LayerNorm (None when post-LN)
        self.generator = generator
        # in training, position-wise work on real tokens only (packing.py; off: --no-packing)
        self.skip_padding = skip_padding
        # --compile-layers: the layers compiled for full passes (modules/compiled.py), or None
        self.compiled: Optional[CompiledLayers] = None
        # --fused-attention-backends: where torch's fused attention may run, during the layers
        self.attention_backends = check_backends(attention_backends)
        # outside training, return the alignment layer's source attention, as fairseq's
        # transformer always does (the hub's hypotheses, --print-alignment); False: the fused
        # kernel in every attention (tests, the cache benchmark's baseline)
        self.need_attn = True
        # beam search's reorder plans: the encoder's (make_model), which each step's reorder
        # then hands the encoder; its own where built alone
        self.reorder_plans = reorder_plans if reorder_plans is not None else ReorderPlans()

    def forward(
        self,
        prev_output_tokens: Tensor,
        encoder_out: Optional[Dict[str, List[Tensor]]] = None,
        incremental_state: Optional[IncrementalState] = None,
        features_only: bool = False,
        alignment_layer: Optional[int] = None,
        alignment_heads: Optional[int] = None,
        src_lengths: Optional[Tensor] = None,
        return_all_hiddens: bool = False,
        **unused,
    ):
        """prev_output_tokens (B, T) -> logits (B, T, V) (T = 1 with incremental_state) and
        {"attn": [source attention (B, T, S) averaged over heads, or None], "inner_states": [...]}
        (src_lengths and return_all_hiddens: fairseq's decoder interface, unused here; the inner
        states come always, as from fairseq's transformer)"""
        x, extra = self.extract_features(
            prev_output_tokens, encoder_out, incremental_state, alignment_layer, alignment_heads)
        if not features_only:
            x = self.output_layer(x)
        return x, extra

    def extract_features(self, prev_output_tokens, encoder_out, incremental_state=None,
                         alignment_layer=None, alignment_heads=None, **unused):
        """(B, T, d) features before the generator, and {"attn", "inner_states"}."""
        # the notebook's masks, True where a query may attend. src_mask: the source's real tokens.
        # tgt_mask: make_std_mask's padding part, the target's real tokens, needed only when a row
        # is left-padded (right padding follows every real token, so the causal mask hides it);
        # its subsequent_mask part is the causal self-attention's (attention.py: attend).
        src_mask = source_mask(encoder_out)  # (B, 1, 1, S) or None
        step_position = None  # a decoding step's: one position for all rows
        if incremental_state is None:  # a full pass, which may run the compiled layers
            tgt_padding = prev_output_tokens.eq(self.padding_idx)  # (B, T)
            padded, left_padded = count_padding(tgt_padding)  # one read back from the device
            tgt_mask = ~tgt_padding[:, None, None, :] if left_padded else None
            layers = self.compiled if self.compiled is not None else self.layers
        else:  # a decoding step: only the newest token is new, and it has nothing to hide
            step_position = self.embed.step_position(prev_output_tokens)
            prev_output_tokens = prev_output_tokens[:, -1:]
            tgt_padding, padded, tgt_mask = None, 0, None
            self.begin_step(incremental_state, encoder_out, prev_output_tokens.size(0))
            layers = self.layers  # (as they are: steps are not compiled)

        memory = encoder_out["encoder_out"][0]  # (B, S, d_memory)
        want_attn = alignment_layer is not None or (self.need_attn and not self.training)
        if alignment_layer is None:
            alignment_layer = len(self.layers) - 1
        x = self.embed(prev_output_tokens, step_position)  # (B, T, d); None: counted per row
        # in training, position-wise work on real tokens only (modules/packing.py); not when the
        # source attention is returned: packed, its rows at padding would come from zero queries
        # (uniform weights), not from the padding positions' own
        packing = packing_for(tgt_padding, padded,
                              self.skip_padding and self.training and not want_attn)
        x = packing.pack(x)
        attn, inner_states = None, [x]
        with fused_backends(self.attention_backends, x.device):
            for i, layer in enumerate(layers):
                x, layer_attn = layer(x, memory, src_mask=src_mask, tgt_mask=tgt_mask,
                                      incremental_state=incremental_state,
                                      need_attn=want_attn and i == alignment_layer,
                                      packing=packing)
                inner_states.append(x)
                if i == alignment_layer:
                    attn = layer_attn
        x = packing.unpack(x)
        if self.norm is not None:  # pre-LN's final LayerNorm
            x = self.norm(x)
        # (B, T, d) each: batch-first, unlike fairseq's transformer
        inner_states = [packing.unpack(s) for s in inner_states]
        return x, {"attn": [average_heads(attn, alignment_heads)], "inner_states": inner_states}

    def output_layer(self, features: Tensor) -> Tensor:
        return self.generator(features)

    def max_positions(self) -> int:
        return self.embed.max_positions

    # -- Incremental decoding: every attention module keeps a cache in fairseq's incremental_state
    # (modules/cache.py); the decoder starts them, adds each step to the beam's ancestry and hands
    # them beam search's reorders. Training and full passes never come here.

    def attentions(self) -> List[MultiHeadedAttention]:
        return [m for layer in self.layers for m in (layer.self_attn, layer.src_attn)]

    def begin_step(self, incremental_state: IncrementalState,
                   encoder_out: Dict[str, List[Tensor]], rows: int) -> None:
        """Before each decoding step of ``rows`` hypotheses: empty caches at the first, then the
        new step in the beam's ancestry."""
        if self.layers[0].self_attn.cache(incremental_state) is None:
            self.start_caches(incremental_state, beam_group(encoder_out), rows)
        ancestry = self.get_incremental_state(incremental_state, "ancestry")
        if ancestry is not None:
            ancestry.add_step()

    def start_caches(self, incremental_state: IncrementalState, group: int, rows: int) -> None:
        """Empty caches for every attention module. When the encoder output holds its sentences in
        groups of ``group`` copies (the beam), each group shares storage, and the self-attention
        caches share one ancestry of the hypotheses (modules/cache.py)."""
        ancestry = None
        if group > 1:
            weight = self.embed.embeddings.lut.weight
            ancestry = Ancestry(rows, group, weight.dtype, weight.device)
            self.set_incremental_state(incremental_state, "ancestry", ancestry)
        for attention in self.attentions():
            attention.start_cache(incremental_state, group, ancestry)

    def reorder_incremental_state_scripting(self, incremental_state: IncrementalState,
                                            new_order: Tensor) -> None:
        """Beam search's reorder, once per step: worked out once (BeamReorder), then followed by
        every cache and by the beam's ancestry while a cache reads it. (Replaces fairseq's walk
        over every submodule.)"""
        reorder = self.reorder_plans.reorder(new_order)
        for attention in self.attentions():
            attention.reorder_cache(incremental_state, reorder)
        ancestry = self.get_incremental_state(incremental_state, "ancestry")
        if ancestry is None:
            return
        read = any(layer.self_attn.cache(incremental_state).ancestry is ancestry
                   for layer in self.layers)  # not when every cache ungrouped (attention weights)
        if not read or not ancestry.reorder(reorder):
            self.set_incremental_state(incremental_state, "ancestry", None)  # no groups any more


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
            skip_padding=not args.no_packing, attention_backends=backends,
            reorder_plans=encoder.reorder_plans)
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
        encoder then records when beam search repeats each sentence beam_size times, and the
        decoder's caches keep each sentence's keys and values once (modules/cache.py)."""
        self.encoder.beam_size = beam_size

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


FINGERPRINT = "dictionary_fingerprint"  # the model's buffer (config.dictionary_fingerprint)


def drawn_by_its_module(name: str, linear_init: str) -> bool:
    """Whether init_parameters_ leaves the parameter ``name`` to its module's own rule: the
    attention's (MultiHeadedAttention.reset_parameters, each of W^Q, W^K, W^V, W^O on its own),
    and with --linear-init fairseq the feed-forward's (torch's nn.Linear default)."""
    parts = name.split(".")
    return ("self_attn" in parts or "src_attn" in parts
            or (linear_init == "fairseq" and "feed_forward" in parts))


def check_compatible(expected: Dict[str, Tensor], loaded: Dict[str, Tensor],
                     strict: bool = True) -> None:
    """Explain why a checkpoint's parameters do not fit this model, or return. Parameters this
    model lacks are ignored when not strict (as torch does); missing ones are refused always."""
    missing = [k for k in expected if k not in loaded]
    unexpected = [k for k in loaded if k not in expected]
    if unexpected and len(missing) > len(expected) // 2:  # before any advice about LayerNorms
        raise PluginError(
            f"the checkpoint holds another architecture's parameters (e.g. {unexpected[0]}), not "
            f"an annotated_transformer's; load it with the --arch it was trained with (its "
            f"checkpoint's cfg.model), or train this model from scratch")
    for stack in ("encoder", "decoder"):  # pre-LN's final LayerNorm: in one of them only
        final_norm = f"{stack}.norm.weight"
        if final_norm in missing or final_norm in unexpected:  # also when not strict
            trained, built = ("pre", "post") if final_norm in unexpected else ("post", "pre")
            raise PluginError(
                f"the checkpoint's {stack} is {trained}-LN but these options build a {built}-LN "
                f"{stack}; a checkpoint trained with one --*-normalize-before flag before the "
                f"flags kept fairseq's per-stack meaning is pre-LN in both stacks: load it with "
                f"--model-overrides \"{{'encoder_normalize_before': True, "
                f"'decoder_normalize_before': True}}\"")
    if missing or (unexpected and strict):
        found = (f"missing {missing[0]}" + (f", has {unexpected[0]} instead" if unexpected else "")
                 if missing else f"has {unexpected[0]}, which this model lacks")
        raise PluginError(
            f"the checkpoint does not hold this model's parameters ({found}); it was trained "
            f"with another --arch or other flags: load it with those")
    for k, v in expected.items():
        if torch.is_tensor(v) and tuple(loaded[k].shape) != tuple(v.shape):
            if k.endswith("embeddings.lut.weight") or k.endswith("generator.proj.weight"):
                raise dictionary_size_error(loaded[k].shape[0], v.shape[0])
            raise PluginError(
                f"the checkpoint's {k} has shape {tuple(loaded[k].shape)} but this model's has "
                f"{tuple(v.shape)}; it was trained with other sizes: load it with those flags")


def resolved_model_config(model_cfg) -> Optional[Namespace]:
    """Every option of the annotated_transformer a model configuration builds, or None when it
    is not an annotated_transformer configuration."""
    arch = getattr(model_cfg, "_name", None) or getattr(model_cfg, "arch", None)
    model = ARCH_MODEL_REGISTRY.get(arch)
    if model is None or not issubclass(model, AnnotatedTransformerModel):
        return None
    return model.options(model_cfg)


# ---------------------------------------------------------------------------------------------
# Presets, registered next to the model: annotated_transformer with other defaults. Each is a
# model name with its own config class, so that `--arch NAME` on the command line and
# `model._name: NAME` in a fairseq-hydra-train recipe start from the same values.
# ---------------------------------------------------------------------------------------------

def register_preset(name: str, summary: str, **defaults):
    config = make_dataclass(
        "".join(part.title() for part in name.split("_")) + "Config",
        [(f.name, f.type, field(default=defaults.get(f.name, f.default), metadata=f.metadata))
         for f in fields(AnnotatedTransformerConfig)],
        bases=(AnnotatedTransformerConfig,))
    config.__doc__, config.__module__ = summary, __name__
    model = type(config.__name__.replace("Config", "Model"), (AnnotatedTransformerModel,),
                 {"__doc__": summary, "__module__": __name__})
    return register_model(name, dataclass=config)(model)


register_preset("annotated_transformer_iwslt_de_en",
                "Like fairseq's transformer_iwslt_de_en: 6+6 layers, d_model 512, d_ff 1024, 4 heads.",
                encoder_ffn_embed_dim=1024, encoder_attention_heads=4, decoder_attention_heads=4)
register_preset("annotated_transformer_big",
                "The paper's big model: d_model 1024, d_ff 4096, h=16, P_drop 0.3.",
                encoder_embed_dim=1024, encoder_ffn_embed_dim=4096, encoder_attention_heads=16,
                decoder_attention_heads=16, dropout=0.3)
register_preset("annotated_transformer_tiny",
                "Small and fast, for tests and sanity tasks: 2+2 layers, d_model 64, d_ff 256, 4 heads.",
                encoder_embed_dim=64, encoder_ffn_embed_dim=256, encoder_layers=2,
                decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4)
