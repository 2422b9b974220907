"""The self-attention cache of incremental decoding: keys and values of the steps decoded so far.

Beam search keeps g hypotheses per sentence and after every step reorders them: row i of the next
step continues hypothesis new_order[i]. A cache with one history per row must then copy every
row's history into the new order, each step, at a cost that grows with the length decoded.

Here the g rows of a sentence keep their history together, step by step: key ``s * g + r`` of the
group is step s of the hypothesis that was in row r at step s. A reorder within the groups moves
no keys, only each row's ancestry: an additive mask over the group's keys, 0 at the row's own
ancestors and -inf elsewhere, (B, steps * g) numbers instead of (B, h, steps, d_k). Attending to
all the group's keys under that mask is attending to the row's own history, since a -inf score
gets weight exp(-inf) = 0. (The same ancestry mask is what tree attention uses to decode several
continuations of one prefix at once, e.g. SpecInfer, Miao et al. 2023.)

With g = 1 (greedy search, or once a reorder has moved a row into another sentence's group) each
row has its own history, and a pending reorder is applied as one row gather before the next step.

Shapes: B rows, h heads, d_k head size, t steps cached, C capacity in steps.
"""

from typing import Optional, Tuple

import torch
from torch import Tensor

MIN_CAPACITY = 32  # steps allocated at first; doubled when full


class SelfAttentionHistory:
    """Keys and values (B, h, t, d_k) appended step by step and reordered by beam search."""

    def __init__(self, group: int = 1):
        self.group = group  # g rows that share storage (one sentence's hypotheses)
        self.length = 0  # t
        self.k: Optional[Tensor] = None  # (B / g, h, C * g, d_k)
        self.v: Optional[Tensor] = None
        self.ancestry: Optional[Tensor] = None  # g > 1: (B, C * g), 0 at own keys, -inf elsewhere
        self.order: Optional[Tensor] = None  # g = 1: the reorder still to apply
        self.spare: Tuple[Optional[Tensor], Optional[Tensor]] = (None, None)  # g = 1

    def append(self, k: Tensor, v: Tensor) -> None:
        """Add steps k, v (B, h, T, d_k), one row per hypothesis in the current order."""
        if self.group > 1 and (k.size(2) > 1 or k.size(0) % self.group):
            self.ungroup()  # several steps at once take the per-row path
        if self.k is None:
            self._allocate(k, k.size(0), max(MIN_CAPACITY, k.size(2)))
        if self.group == 1:
            self._apply_order()
        g, t, T = self.group, self.length, k.size(2)
        if (t + T) * g > self.k.size(2):
            self._grow(2 * (t + T))
        if g == 1:
            self.k[:, :, t:t + T] = k
            self.v[:, :, t:t + T] = v
        else:  # (B, h, 1, d_k) -> (B / g, h, g, d_k): row r of a group goes to key t * g + r
            B = k.size(0)
            self.k[:, :, t * g:(t + 1) * g] = k.squeeze(2).unflatten(0, (B // g, g)).transpose(1, 2)
            self.v[:, :, t * g:(t + 1) * g] = v.squeeze(2).unflatten(0, (B // g, g)).transpose(1, 2)
            step = self.ancestry.view(B // g, g, -1)[:, :, t * g:(t + 1) * g]  # (B / g, g, g)
            step.diagonal(dim1=1, dim2=2).fill_(0.0)  # each row attends to its own new key
        self.length = t + T

    def keys_values(self) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
        """What the newest queries attend to: keys and values (B / g, h, t * g, d_k) and, for
        g > 1, the additive ancestry mask (B / g, 1, g, t * g) of the group's g queries."""
        g, t = self.group, self.length
        k, v = self.k[:, :, :t * g], self.v[:, :, :t * g]
        if g == 1:
            return k, v, None
        B = self.ancestry.size(0)
        return k, v, self.ancestry[:, :t * g].view(B // g, 1, g, t * g)

    def rows(self) -> Tuple[Tensor, Tensor]:
        """Each row's own history, (B, h, t, d_k) keys and values, in the current order."""
        g, t = self.group, self.length
        if g == 1:
            k, v = self.k[:, :, :t], self.v[:, :, :t]
            if self.order is not None:
                k, v = k.index_select(0, self.order), v.index_select(0, self.order)
            return k, v
        B = self.ancestry.size(0)
        # row i's ancestor at step s sits in slot argmax(ancestry) (the only 0 among -inf)
        slot = self.ancestry[:, :t * g].view(B, t, g).argmax(-1)  # (B, t)
        key = torch.arange(t, device=slot.device) * g + slot  # (B, t) index within the group
        group = (torch.arange(B, device=slot.device) // g)[:, None].expand(B, t)
        # advanced indices around a slice: (B, t, h, d_k) -> (B, h, t, d_k)
        return self.k[group, :, key].transpose(1, 2), self.v[group, :, key].transpose(1, 2)

    def reorder(self, new_order: Tensor) -> None:
        """Row i continues the hypothesis of row new_order[i]; rows may be dropped (finished
        sentences). Within-group reorders only gather the ancestry masks."""
        g = self.group
        if g == 1 or self.k is None:
            self.order = new_order if self.order is None else self.order.index_select(0, new_order)
            return
        if new_order.numel() % g:
            self.ungroup()
            return self.reorder(new_order)
        old_group = new_order.view(-1, g) // g  # (B' / g, g): the group each new row comes from
        kept = old_group[:, 0]
        if not bool((old_group == kept[:, None]).all()):  # a row changes sentence
            self.ungroup()
            return self.reorder(new_order)
        if kept.numel() != self.k.size(0) or not torch.equal(
                kept, torch.arange(kept.numel(), device=kept.device)):  # sentences finished
            self.k, self.v = self.k.index_select(0, kept), self.v.index_select(0, kept)
        self.ancestry = self.ancestry.index_select(0, new_order)

    def ungroup(self) -> None:
        """Switch to one history per row (g = 1)."""
        if self.group == 1:
            return
        rows = self.rows() if self.k is not None else None
        self.group, self.ancestry = 1, None
        if rows is not None:
            k, v = rows
            self._allocate(k, k.size(0), max(MIN_CAPACITY, self.length))
            self.k[:, :, :self.length], self.v[:, :, :self.length] = k, v

    def _allocate(self, like: Tensor, B: int, capacity: int) -> None:
        """Empty buffers for capacity steps of B rows, h and d_k (and dtype, device) of like."""
        g, h, d_k = self.group, like.size(1), like.size(-1)
        self.k = like.new_empty(B // g, h, capacity * g, d_k)
        self.v = like.new_empty(B // g, h, capacity * g, d_k)
        self.spare = (None, None)
        if g > 1:
            self.ancestry = like.new_full((B, capacity * g), float("-inf"))

    def _grow(self, capacity: int) -> None:
        used = self.length * self.group
        k, v, ancestry = self.k, self.v, self.ancestry
        self._allocate(k, k.size(0) * self.group, capacity)
        self.k[:, :, :used], self.v[:, :, :used] = k[:, :, :used], v[:, :, :used]
        if ancestry is not None:
            self.ancestry[:, :used] = ancestry[:, :used]

    def _apply_order(self) -> None:
        """g = 1: gather the rows into the pending order, into a spare buffer that then becomes
        the current one (one copy of the history, in large contiguous pieces)."""
        if self.order is None:
            return
        t, order = self.length, self.order
        shape = (order.numel(),) + self.k.shape[1:]
        spare_k, spare_v = self.spare
        if spare_k is None or spare_k.shape != shape:
            spare_k, spare_v = self.k.new_empty(shape), self.v.new_empty(shape)
        torch.index_select(self.k[:, :, :t], 0, order, out=spare_k[:, :, :t])
        torch.index_select(self.v[:, :, :t], 0, order, out=spare_v[:, :, :t])
        self.spare = (self.k, self.v)
        self.k, self.v, self.order = spare_k, spare_v, None
