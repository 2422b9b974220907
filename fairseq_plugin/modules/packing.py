"""Skipping padding in training: position-wise work runs on the real tokens only.

Linear layers, layer norms, dropout and residual additions treat every position on its own, so
they need not run on padding: a (B, L, d) batch is packed into its N real positions (N, d) for
them, and unpacked to (B, L, ...) only where attention mixes positions. The idea is the "remove
padding" of NVIDIA's FasterTransformer / Effective Transformer; fairseq's transformer computes
every padded position.

The layers of modules/layers.py take the packing as an argument and run their usual ``forward``
on the rows they are given; only ``MultiHeadedAttention`` is given rows that know their places in
the batch (``PackedRows``, as an RNN is given a PackedSequence), to unpack its projections before
attending and pack its output after W^O (W^O runs on padding too: its input is then the
attention kernel's output, which backward keeps anyway, instead of a packed copy kept besides).
A ``Packing`` is either ``RealPositions`` or ``AllPositions`` (``NO_PACKING``, the default),
which leaves a batch as it is.
The results at real positions are the same either way (tested); only the work on padding is saved
(docs/benchmarks.md). The model's ``--no-packing`` leaves every batch as it is.
"""

from typing import NamedTuple, Optional, Union

import torch
from torch import Tensor

from ..torch_release import TORCH_RELEASE

# Packing copies activations; it pays for that only where a per cent or two of the positions or more
# are padding (fairseq batches sources by length: they have almost none)
MIN_PADDING_SHARE = 0.02

# nonzero() reads the number of positions it finds back from the device to size its output, and
# on a GPU that read waits for everything queued before it; nonzero_static, told the number, need
# not. Its devices: the CPU since torch 2.1, CUDA since 2.6.
_NONZERO_STATIC_DEVICES = {"cpu", "cuda"} if TORCH_RELEASE >= (2, 6) else {"cpu"}


def pack(x: Tensor, index: Tensor) -> Tensor:
    """(B, L, ...) -> (N, ...): the rows at ``index`` (N,) of the flattened B * L positions."""
    return x.reshape(-1, *x.shape[2:]).index_select(0, index)


def unpack(x: Tensor, real: Tensor, index: Tensor) -> Tensor:
    """(N, ...) -> (B, L, ...), zeros at padding; ``real`` (B, L) True at the N real positions,
    ``index`` their places in B * L. (index_put keeps only the positions for its backward;
    index_copy would keep all of x, a second copy of every unpacked projection. In place into the
    zeros: the out-of-place index_put would copy them first.)"""
    out = x.new_zeros(real.numel(), *x.shape[1:]).index_put_((index,), x)
    return out.view(*real.shape, *x.shape[1:])


class PackedRows(NamedTuple):
    """An attention's query as the real rows of a (B, L) batch and their places in it: rows
    (N, d_model), real (B, L) True at real tokens, index (N,) in B * L. Plain tensors: torch 2.1's
    compiler loses track of an object's tensors carried inside a tuple."""
    rows: Tensor
    real: Tensor
    index: Tensor


class RealPositions:
    """The real (non-padding) positions of a (B, L) batch."""

    def __init__(self, real: Tensor, count: int):
        """``count``: how many of ``real`` are True (N), read back from the device by the caller
        together with what else it needs to know of the batch."""
        self.real = real  # (B, L), True at real tokens (its sizes, not a torch.Size: under
        # torch.compile a tensor's sizes are symbolic, a kept Size would be a constant)
        flat = real.reshape(-1)
        if flat.device.type in _NONZERO_STATIC_DEVICES:
            self.index = torch.nonzero_static(flat, size=count).squeeze(1)  # (N,) in B * L
        else:  # reads N back itself
            self.index = flat.nonzero().squeeze(1)

    def pack(self, x: Tensor) -> Tensor:
        """(B, L, ...) -> (N, ...)"""
        return pack(x, self.index)

    def unpack(self, x: Tensor) -> Tensor:
        """(N, ...) -> (B, L, ...), zeros at padding."""
        return unpack(x, self.real, self.index)

    def rows(self, x: Tensor) -> PackedRows:
        """The packed rows x (N, d_model) as an attention's query."""
        return PackedRows(x, self.real, self.index)


class AllPositions:
    """Every position, padding included: the batch as it is."""

    @staticmethod
    def pack(x: Tensor) -> Tensor:
        return x

    @staticmethod
    def unpack(x: Tensor) -> Tensor:
        return x

    @staticmethod
    def rows(x: Tensor) -> Tensor:
        return x


NO_PACKING = AllPositions()
Packing = Union[RealPositions, AllPositions]  # which positions a layer's input rows are


def packing_for(padding_mask: Optional[Tensor], padded: int,
                enabled: bool = True) -> Packing:
    """What the layers run on, given the (B, L) padding mask (True at padding; None: no
    padding to skip) and how many of its positions are padding (read back by the caller)."""
    if not enabled or padding_mask is None or padded < MIN_PADDING_SHARE * padding_mask.numel():
        return NO_PACKING
    return RealPositions(~padding_mask, padding_mask.numel() - padded)
