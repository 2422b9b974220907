"""Skipping padding in position-wise work: the feed-forward sub-layers see only real tokens.

The feed-forward network, its layer norm, dropout and residual addition treat every position on
its own, so they need not run on padding: a (B, L, d) batch is packed into its N real positions
(N, d) for them and unpacked afterwards. Attention, which mixes positions, keeps the (B, L)
layout. The idea is the "remove padding" of NVIDIA's FasterTransformer / Effective Transformer;
fairseq's transformer computes every padded position. Results are the same with or without
(tested); only the work on padding is saved (README, "Speed and memory").
"""

from typing import Callable, Union

from torch import Tensor


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

    def positionwise(self, f: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
        """f applied to the real positions of x (B, L, d) only; zeros at padding."""
        return self.unpack(f(self.pack(x)))


class NoPacking:
    """Every position, padding included (no padding, or packing switched off)."""

    @staticmethod
    def positionwise(f: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
        return f(x)


# Packing copies the activations twice per sub-layer; it pays for that only where a few per cent
# of the positions are padding or more (fairseq batches sources by length: they have almost none)
MIN_PADDING_SHARE = 0.05


def real_positions(padding_mask: Tensor, enabled: bool = True) -> Union[Packing, NoPacking]:
    """What position-wise work runs on, given the (B, L) padding mask (True at padding)."""
    if not enabled or padding_mask.float().mean() < MIN_PADDING_SHARE:
        return NoPacking()
    return Packing(~padding_mask)
