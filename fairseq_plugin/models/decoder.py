"""The decoder: "The decoder is also composed of a stack of N = 6 identical layers." (Vaswani et
al. 2017, section 3.1) The notebook's ``Decoder``, ``EncoderDecoder.decode`` and ``Generator``,
with fairseq's incremental state for beam search (modules/cache.py); built by the model's
``make_model`` (annotated_transformer.py).

Tensors are batch-first: B batch, S source length, T target length, d d_model.
"""

from typing import Dict, List, Optional, Tuple

import torch
from fairseq.models import FairseqIncrementalDecoder
from torch import Tensor, nn

from ..modules.attention import (NO_CUDNN, IncrementalState, MultiHeadedAttention, check_backends,
                                 fused_backends)
from ..modules.beam import BeamSearchState
from ..modules.compiled import CompiledLayers
from ..modules.embeddings import EmbeddingLayer, Generator
from ..modules.layers import DecoderLayer
from ..modules.packing import packing_for
from .encoder import source_mask

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
                 attention_backends: str = NO_CUDNN):
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
        # beam search's state (modules/beam.py): make_model gives it the encoder's
        self.beam = BeamSearchState()

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
            self.beam.begin_step(incremental_state, encoder_out, self.attentions(),
                                 prev_output_tokens.size(0))
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
    # (modules/cache.py), which the model's beam-search state starts and reorders
    # (modules/beam.py). Training and full passes never come here.

    def attentions(self) -> List[MultiHeadedAttention]:
        return [m for layer in self.layers for m in (layer.self_attn, layer.src_attn)]

    def reorder_incremental_state_scripting(self, incremental_state: IncrementalState,
                                            new_order: Tensor) -> None:
        """Beam search's reorder, once per step (replaces fairseq's walk over every submodule)."""
        self.beam.reorder(incremental_state, self.attentions(), new_order)
