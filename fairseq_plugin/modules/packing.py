"""Skipping padding in the position-wise parts of the decoder.

Linear layers, layer norms, dropout and residual additions treat every position on its own, so
they need not run on padding: a batch of target sentences of different lengths is packed into
its N real positions (N, ...) for them, and unpacked to (B, T, ...) only for attention, which
mixes positions. The idea is the "remove padding" of NVIDIA's FasterTransformer / Effective
Transformer; fairseq's transformer computes every padded position.
"""

from torch import Tensor


class Packing:
    """The real (non-padding) positions of a (B, T) batch."""

    def __init__(self, real: Tensor):
        self.shape = real.shape  # (B, T)
        self.index = real.reshape(-1).nonzero().squeeze(1)  # (N,) positions in B * T

    def pack(self, x: Tensor) -> Tensor:
        """(B, T, ...) -> (N, ...)"""
        return x.reshape(-1, *x.shape[2:]).index_select(0, self.index)

    def unpack(self, x: Tensor) -> Tensor:
        """(N, ...) -> (B, T, ...), zeros at padding."""
        out = x.new_zeros(self.shape.numel(), *x.shape[1:]).index_copy(0, self.index, x)
        return out.view(*self.shape, *x.shape[1:])
