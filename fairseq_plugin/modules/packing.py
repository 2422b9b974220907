"""Skipping padding in training: position-wise work runs on the real tokens only.

Linear layers, layer norms, dropout and residual additions treat every position on its own, so
they need not run on padding: a (B, L, d) batch is packed into its N real positions (N, d) for
them, and unpacked to (B, L, ...) only where attention mixes positions. The idea is the "remove
padding" of NVIDIA's FasterTransformer / Effective Transformer; fairseq's transformer computes
every padded position.

``Packing.encoder_layer`` / ``decoder_layer`` run a layer of modules/layers.py this way, with the
same modules and the same steps as its ``forward``: the results at real positions are the same
(tested), only the work on padding is saved (README, "Speed and memory"). ``NoPacking`` runs the
layers as they are.
"""

from typing import Optional, Tuple, Union

from torch import Tensor

from .attention import attend, choose_kernel

# Packing copies activations; it pays for that only where a per cent or two of the positions or more
# are padding (fairseq batches sources by length: they have almost none)
MIN_PADDING_SHARE = 0.02


class Packing:
    """The real (non-padding) positions of a (B, L) batch."""

    def __init__(self, real: Tensor):
        self.shape = real.shape  # (B, L)
        self.index = real.reshape(-1).nonzero().squeeze(1)  # (N,) positions in B * L

    def pack(self, x: Tensor) -> Tensor:
        """(B, L, ...) -> (N, ...)"""
        return x.reshape(-1, *x.shape[2:]).index_select(0, self.index)

    def unpack(self, x: Tensor) -> Tensor:
        """(N, ...) -> (B, L, ...), zeros at padding."""
        out = x.new_zeros(self.shape.numel(), *x.shape[1:]).index_copy(0, self.index, x)
        return out.view(*self.shape, *x.shape[1:])

    def encoder_layer(self, layer, rows: Tensor, mask: Optional[Tensor]) -> Tensor:
        """EncoderLayer.forward on packed rows (N, d)."""
        rows = layer.sublayer[0](rows, lambda y: self.attention(layer.self_attn, y, None, mask))
        return layer.sublayer[1](rows, layer.feed_forward)

    def decoder_layer(self, layer, rows: Tensor, memory: Tensor, tgt_mask: Optional[Tensor],
                      src_mask: Optional[Tensor], incremental_state=None,
                      need_attn: bool = False) -> Tuple[Tensor, None]:
        """DecoderLayer.forward on packed rows (N, d), in training (no cache, no weights)."""
        assert incremental_state is None and not need_attn, "packing is for training only"
        rows = layer.sublayer[0](rows, lambda y: self.attention(
            layer.self_attn, y, None, tgt_mask, causal=True))
        rows = layer.sublayer[1](rows, lambda y: self.attention(
            layer.src_attn, y, memory, src_mask))
        return layer.sublayer[2](rows, layer.feed_forward), None

    def attention(self, attn, rows: Tensor, memory: Optional[Tensor], mask: Optional[Tensor],
                  causal: bool = False) -> Tensor:
        """``attn(query, memory, mask, causal)[0]`` for a query given as its real rows (N, d):
        the projections W^Q, W^K, W^V, W^O run on the rows, attention on the (B, L) layout."""
        B, L = self.shape
        if attn.self_attention:
            q, k, v = attn.split_heads(self.unpack(attn.qkv_proj(rows)), 3)
        else:
            (q,) = attn.split_heads(self.unpack(attn.q_proj(rows)), 1)
            k, v = attn.split_heads(attn.kv_proj(memory), 2)
        kernel = choose_kernel(False, attn.kernel)
        out, _ = attend(q, k, v, mask, causal, attn.dropout, kernel)
        return attn.out_proj(self.pack(out.transpose(1, 2).reshape(B, L, -1)))


class NoPacking:
    """Every position, padding included: the layers as they are."""

    @staticmethod
    def pack(x: Tensor) -> Tensor:
        return x

    @staticmethod
    def unpack(x: Tensor) -> Tensor:
        return x

    @staticmethod
    def encoder_layer(layer, x: Tensor, mask: Optional[Tensor]) -> Tensor:
        return layer(x, mask)

    @staticmethod
    def decoder_layer(layer, x: Tensor, memory: Tensor, tgt_mask: Optional[Tensor],
                      src_mask: Optional[Tensor], incremental_state=None, need_attn=False):
        return layer(x, memory, tgt_mask, src_mask, incremental_state, need_attn)


def real_positions(padding_mask: Tensor, enabled: bool = True) -> Union[Packing, NoPacking]:
    """What the layers run on, given the (B, L) padding mask (True at padding)."""
    if not enabled or padding_mask.float().mean() < MIN_PADDING_SHARE:
        return NoPacking()
    return Packing(~padding_mask)
