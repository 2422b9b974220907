"""Encoder and decoder layers of the Annotated Transformer.

Shapes: B batch, T target length, S source length, d_model model dimension.
"""

from typing import Callable, Dict, Optional

from torch import Tensor, nn

from .attention import MultiHeadedAttention
from .dropout import Dropout
from .packing import Packing


class SublayerConnection(nn.Module):
    """A residual connection around a sub-layer, with layer normalisation.

    The paper (post-LN): "the output of each sub-layer is LayerNorm(x + Sublayer(x))", with
    dropout "to the output of each sub-layer, before it is added to the sub-layer input"
    (sections 3.1, 5.4). The Annotated Transformer's default (pre-LN, "norm first"):
    x + Dropout(Sublayer(LayerNorm(x))), with a final LayerNorm after the stack.
    We use ``nn.LayerNorm`` (biased variance, fused) rather than the notebook's hand-written one.
    """

    def __init__(self, d_model: int, dropout: float, normalize_before: bool):
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.dropout = Dropout(dropout)
        self.normalize_before = normalize_before

    def forward(self, x: Tensor, sublayer: Callable[[Tensor], Tensor]) -> Tensor:
        if self.normalize_before:
            return x + self.dropout(sublayer(self.norm(x)))
        return self.norm(x + self.dropout(sublayer(x)))


class PositionwiseFeedForward(nn.Module):
    """FFN(x) = max(0, x W_1 + b_1) W_2 + b_2, applied to each position (section 3.3)."""

    def __init__(self, d_model: int, d_ff: int, activation: Callable[[Tensor], Tensor],
                 activation_dropout: float):
        super().__init__()
        self.w_1 = nn.Linear(d_model, d_ff)
        self.w_2 = nn.Linear(d_ff, d_model)
        self.activation = activation
        self.dropout = Dropout(activation_dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.w_2(self.dropout(self.activation(self.w_1(x))))


class EncoderLayer(nn.Module):
    """"Each layer has two sub-layers. The first is a multi-head self-attention mechanism, and the
    second is a simple, position-wise fully connected feed-forward network." (section 3.1)"""

    def __init__(self, d_model: int, self_attn: MultiHeadedAttention,
                 feed_forward: PositionwiseFeedForward, dropout: float, normalize_before: bool):
        super().__init__()
        self.self_attn = self_attn
        self.feed_forward = feed_forward
        self.sublayer = nn.ModuleList(
            [SublayerConnection(d_model, dropout, normalize_before) for _ in range(2)])

    def forward(self, x: Tensor, padding_mask: Optional[Tensor]) -> Tensor:
        """x (B, S, d_model); padding_mask (B, S) True at padding, or None."""
        x = self.sublayer[0](x, lambda y: self.self_attn(y, key_padding_mask=padding_mask)[0])
        return self.sublayer[1](x, self.feed_forward)


class DecoderLayer(nn.Module):
    """"In addition to the two sub-layers in each encoder layer, the decoder inserts a third
    sub-layer, which performs multi-head attention over the output of the encoder stack."
    (section 3.1)"""

    def __init__(self, d_model: int, self_attn: MultiHeadedAttention,
                 src_attn: MultiHeadedAttention, feed_forward: PositionwiseFeedForward,
                 dropout: float, normalize_before: bool):
        super().__init__()
        self.self_attn = self_attn
        self.src_attn = src_attn
        self.feed_forward = feed_forward
        self.sublayer = nn.ModuleList(
            [SublayerConnection(d_model, dropout, normalize_before) for _ in range(3)])

    def forward(
        self,
        x: Tensor,
        memory: Tensor,
        memory_padding_mask: Optional[Tensor],
        incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]] = None,
        need_attn: bool = False,
        memory_ids: Optional[Tensor] = None,
        packing: Optional[Packing] = None,
        self_attn_padding_mask: Optional[Tensor] = None,
    ):
        """x (B, T, d_model), or (N, d_model) packed by ``packing``; memory (B, S, d_model);
        memory_padding_mask (B, S) True at padding; self_attn_padding_mask (B, T) only needed
        when padding precedes real tokens (left-padded targets).
        Returns x (shaped as given) and, if need_attn, the source attention (B, h, T, S)."""
        x = self.sublayer[0](x, lambda y: self.self_attn(
            y, key_padding_mask=self_attn_padding_mask, causal=True,
            incremental_state=incremental_state, memory_ids=memory_ids, packing=packing)[0])
        attn = [None]

        def src_attn(y):
            out, attn[0] = self.src_attn(
                y, memory, key_padding_mask=memory_padding_mask,
                incremental_state=incremental_state, need_weights=need_attn,
                memory_ids=memory_ids, packing=packing)
            return out

        x = self.sublayer[1](x, src_attn)
        return self.sublayer[2](x, self.feed_forward), attn[0]
