"""The encoder: "The encoder is composed of a stack of N = 6 identical layers." (Vaswani et
al. 2017, section 3.1) The notebook's ``Encoder`` and ``EncoderDecoder.encode``; built by the
model's ``make_model`` (annotated_transformer.py).

Tensors are batch-first: B batch, S source length, d d_model.
"""

from typing import Dict, List, Optional

import torch
from fairseq.models import FairseqEncoder
from torch import Tensor, nn

from ..modules.attention import NO_CUDNN, check_backends, fused_backends
from ..modules.beam import BeamSearchState
from ..modules.compiled import CompiledLayers
from ..modules.embeddings import EmbeddingLayer
from ..modules.layers import EncoderLayer
from ..modules.packing import packing_for


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
        # beam search's state, shared with the decoder (make_model; modules/beam.py)
        self.beam = BeamSearchState()

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
        }

    @torch.jit.unused
    def reorder_encoder_out(self, encoder_out: Dict[str, List[Tensor]], new_order: Tensor):
        """Row i of the result is row new_order[i] of encoder_out; beam search's copies of a
        sentence are not copied again at every step (modules/beam.py)."""
        return self.beam.reorder_encoder_out(encoder_out, new_order)

    def max_positions(self) -> int:
        return self.embed.max_positions


def source_mask(encoder_out: Dict[str, List[Tensor]]) -> Optional[Tensor]:
    """The encoder's src_mask (B, 1, 1, S), True at real tokens; None when nothing is padded."""
    mask = encoder_out["src_mask"]
    return mask[0] if mask else None
