"""Encoder and decoder layers of the Annotated Transformer.

Shapes: B batch, T target length, S source length, d_model model dimension. In training the
layers may run on the real positions (N, d_model) of a batch instead (``packing``, packing.py):
every sub-layer but attention treats each position on its own. ``Dropout`` (dropout.py) is
torch's dropout, but on the CPU, where it draws a cheaper mask (p rounded to a multiple of 2^-15).
"""

from typing import Callable, Optional, Tuple

from torch import Tensor, nn

from .attention import IncrementalState, MultiHeadedAttention
from .dropout import Dropout
from .packing import NO_PACKING, Packing


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
        self.dropout = Dropout(dropout, type(self).__name__)
        self.normalize_before = normalize_before

    def forward(self, x: Tensor, sublayer: Callable[[Tensor], Tensor]) -> Tensor:
        return self.output(x, sublayer(self.input(x)))

    def attention(self, x: Tensor, attention: MultiHeadedAttention, *args,
                  packing: Packing = NO_PACKING, **kwargs) -> Tuple[Tensor, Optional[Tensor]]:
        """The same around an attention sub-layer, ``attention(input(x), *args, **kwargs)``,
        returning its weights too (None unless asked for): the notebook's
        ``sublayer(x, lambda x: self_attn(x, x, x, mask))``, written without a closure. Packed
        rows reach attention with their places in the batch (``PackedRows``)."""
        out, weights = attention(packing.rows(self.input(x)), *args, **kwargs)
        return self.output(x, out), weights

    def input(self, x: Tensor) -> Tensor:
        """What the sub-layer is given: LayerNorm(x) (pre-LN), or x (post-LN)."""
        return self.norm(x) if self.normalize_before else x

    def output(self, x: Tensor, y: Tensor) -> Tensor:
        """The residual connection around the sub-layer's output y: x + Dropout(y) (pre-LN), or
        LayerNorm(x + Dropout(y)) (post-LN)."""
        if self.normalize_before:
            return x + self.dropout(y)
        return self.norm(x + self.dropout(y))


class PositionwiseFeedForward(nn.Module):
    """FFN(x) = max(0, x W_1 + b_1) W_2 + b_2, applied to each position (section 3.3): with the
    default --activation-fn relu; dropout (--activation-dropout) after the activation."""

    def __init__(self, d_model: int, d_ff: int, activation: Callable[[Tensor], Tensor],
                 activation_dropout: float):
        super().__init__()
        self.w_1 = nn.Linear(d_model, d_ff)
        self.w_2 = nn.Linear(d_ff, d_model)
        self.activation = activation
        self.dropout = Dropout(activation_dropout, type(self).__name__)

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

    def forward(self, x: Tensor, mask: Optional[Tensor], packing: Packing = NO_PACKING) -> Tensor:
        """x (B, S, d_model), or its real rows under ``packing``; mask (B, 1, 1, S), True at real
        tokens, or None."""
        x, _ = self.sublayer[0].attention(x, self.self_attn, mask=mask, packing=packing)
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

    def forward(self, x: Tensor, memory: Tensor, src_mask: Optional[Tensor],
                tgt_mask: Optional[Tensor], incremental_state: Optional[IncrementalState] = None,
                need_attn: bool = False, packing: Packing = NO_PACKING
                ) -> Tuple[Tensor, Optional[Tensor]]:
        """The notebook's DecoderLayer(x, memory, src_mask, tgt_mask): x (B, T, d_model), or its
        real rows under ``packing``; memory (B, S, d_memory); src_mask (B, 1, 1, S) / tgt_mask
        (B, 1, 1, T), True at real tokens, or None. Its self-attention is causal
        (``subsequent_mask``: make_model builds it so; see attend).
        Returns x and, if need_attn, the source attention (B, h, T, S)."""
        x, _ = self.sublayer[0].attention(x, self.self_attn, mask=tgt_mask,
                                          incremental_state=incremental_state, packing=packing)
        # the notebook's sublayer[1](x, lambda x: self.src_attn(x, m, m, src_mask))
        x, weights = self.sublayer[1].attention(x, self.src_attn, memory, mask=src_mask,
                                                need_weights=need_attn,
                                                incremental_state=incremental_state,
                                                packing=packing)
        return self.sublayer[2](x, self.feed_forward), weights
