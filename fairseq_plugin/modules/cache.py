"""What incremental decoding keeps between steps: the keys and values attention has already seen.

"The decoder ... generates an output sequence one element at a time" (section 3): at step t only
the newest token is new, so each attention module keeps the keys and values of earlier steps
instead of recomputing them from the whole prefix. Two caches share one interface:

- ``SelfAttentionCache`` (the decoder's self-attention): the keys and values of the steps decoded
  so far; every step appends one.
- ``SourceAttentionCache`` (encoder-decoder attention): the encoder output's keys and values,
  projected once at the first step.

The interface (``KeyValueCache``): ``append`` new keys and values, ``keys_values`` to attend to,
``reorder`` to follow beam search, ``own_keys_values`` for each hypothesis's own keys and values,
and ``ungroup``. Attention appends and reads the same way whichever kind it has; its own kind
decides which projections it runs: self-attention projects the new token's keys and values at
every step, encoder-decoder attention only while its cache ``is_empty`` (the first step), and
only for the ``distinct_rows`` of the encoder output (one per sentence when grouped).

Beam search keeps g hypotheses per sentence (g = the beam size that fairseq's SequenceGenerator
hands the model through ``set_beam_size``) in g consecutive rows, and after every step reorders
them: row i continues the hypothesis of row new_order[i]. A cache with one history per row would
copy every row's history into the new order at every step. Instead the g rows of a sentence keep
their keys together ("grouped"):

- source keys and values are the same for the g rows: they are kept once per sentence;
- self-attention keys are appended side by side: key ``s * g + r`` of a group is step s of the
  hypothesis that was in row r at step s. A reorder within the groups moves no key, only each
  row's ancestry: an additive mask over its group's keys, 0 at its own ancestors and -inf
  elsewhere ((B, steps * g) numbers instead of (B, h, steps, d_k)). Attending to the group's keys
  under that mask is attending to the row's own history, since exp(-inf) = 0. (The same ancestry
  mask is what tree attention uses to decode several continuations of one prefix at once, e.g.
  SpecInfer, Miao et al. 2023.)

The g queries of a group then attend together, as one (g, S) block. A row's ancestry is the same in
every layer: the model's beam-search state (beam.py) keeps one (``Ancestry``), adds each step to
it and reorders it, and the self-attention caches share it. Whether a reorder keeps every row in its sentence's group is
decided once per reorder tensor (``BeamReorder``), for every cache and for the encoder output,
which beam search reorders with the same tensor (``ReorderPlans``, one per model, in beam.py's
state); when it does not
(a hypothesis continues another sentence's row, a batch that was never grouped), the caches fall
back to one row per hypothesis (g = 1) and gather rows.

Shapes: B rows (hypotheses), g rows per group, h heads, d_k head size, S source length,
t steps cached, C capacity in steps.
"""

from abc import ABC, abstractmethod
from typing import Optional, Tuple

import torch
from torch import Tensor

MIN_CAPACITY = 32  # self-attention steps allocated at first; doubled when full
# the masks handed to attention keep their rows a multiple of this many elements apart: on a GPU,
# torch's memory-efficient attention kernel copies (pads) a mask whose rows are not, at every call
MASK_ALIGNMENT = 8


def aligned(n: int) -> int:
    """n rounded up to a multiple of MASK_ALIGNMENT."""
    return -(-n // MASK_ALIGNMENT) * MASK_ALIGNMENT


def plan_reorder(new_order: Tensor, group: int, rows: int) -> Tuple[Optional[Tensor], bool]:
    """What ``new_order`` does to ``rows`` stored rows, each shared by a group of ``group``
    consecutive rows (1: each row its own). Returns (kept, moves):
    - kept: when every row of the new order continues a row of its own group, the old group each
      new group comes from, (B' / group,) (with group 1: ``new_order`` itself); otherwise None;
    - moves: whether the stored rows change (kept is None, or it does not keep them all, in order).
    Beam search's usual step (hypotheses reordered within their sentences, none finished) is
    answered with one read from the device."""
    if group == 1:
        return new_order, not is_identity(new_order, rows)
    if new_order.numel() % group:
        return None, True  # not whole groups
    old_group = new_order.view(-1, group) // group  # (B' / g, g): each new row's old group
    kept = old_group[:, 0]
    if kept.numel() == rows and bool(
            (old_group == torch.arange(rows, device=kept.device)[:, None]).all()):
        return kept, False  # every row stays in its group, and every group in its place
    stays = bool((old_group == kept[:, None]).all())  # every row continues a row of its group
    return (kept if stays else None), True


def repeats_rows(new_order: Tensor, group: int) -> bool:
    """Whether ``new_order`` makes groups of ``group`` copies of one row each, as beam search's
    first reorder does (every sentence repeated beam-size times)."""
    if group <= 1 or new_order.numel() % group:
        return False
    runs = new_order.view(-1, group)
    return bool((runs == runs[:, :1]).all())


def is_identity(index: Tensor, n: int) -> bool:
    """Whether selecting ``index`` from n rows keeps them all, in order."""
    return index.numel() == n and torch.equal(index, torch.arange(n, device=index.device))


class BeamReorder:
    """One reorder of beam search, shared by every cache of a step: row i of the new order
    continues the hypothesis of old row ``new_order[i]`` (rows may be dropped as sentences finish).
    ``plan_reorder`` is worked out once per step (per group size and row count), not once per
    cache: each answer reads a tensor back from the device (on a GPU, a synchronisation).
    ``plans``: answers already worked out for this tensor (``ReorderPlans``)."""

    def __init__(self, new_order: Tensor, plans: Optional[dict] = None):
        self.new_order = new_order
        self._plans = {} if plans is None else plans

    def plan(self, group: int, rows: int) -> Tuple[Optional[Tensor], bool]:
        """``plan_reorder(new_order, group, rows)``, computed once."""
        if (group, rows) not in self._plans:
            self._plans[group, rows] = plan_reorder(self.new_order, group, rows)
        return self._plans[group, rows]


class ReorderPlans:
    """The answers of beam search's latest reorder, held by one model's beam-search state
    (beam.py), which its encoder and decoder share: fairseq's SequenceGenerator hands the decoder's caches and then the encoder
    output the same tensor at each step, so the encoder's reorder reads nothing more from the
    device. ``reorder(new_order)`` gives the step's BeamReorder, with the answers already worked
    out for this very tensor, unchanged since ("unchanged" is what its version counter sees:
    in-place operations on it or on its views, as fairseq's ``add_``, not writes through
    ``.data``). Tensors made under torch.inference_mode count no versions: not shared."""

    def __init__(self):
        self._latest: Tuple[Optional[Tensor], int, dict] = (None, 0, {})  # tensor, version, plans

    def reorder(self, new_order: Tensor) -> BeamReorder:
        if new_order.is_inference():
            return BeamReorder(new_order)
        tensor, version, plans = self._latest
        if tensor is not new_order or version != new_order._version:
            plans = {}
            self._latest = (new_order, new_order._version, plans)
        return BeamReorder(new_order, plans)


class Ancestry:
    """Which of its group's keys each of the B rows descends from, in a grouped self-attention
    cache: an additive mask (B, C * g rounded up to a multiple of MASK_ALIGNMENT), 0 at key
    s * g + r when the row's ancestor at step s was the hypothesis in row r, -inf elsewhere. It
    is the same in every layer: the beam-search state (beam.py) keeps one for all the
    self-attention caches, adds each step before the layers run and reorders it with the caches. (A reorder that takes a row out
    of its group leaves it as it is: the caches then read it once more, to fall back to one
    history per row.)"""

    def __init__(self, rows: int, group: int, dtype: torch.dtype, device):
        if group < 2 or rows % group:
            raise ValueError(f"an ancestry is kept for groups of g > 1 rows, not {rows} rows "
                             f"in groups of {group}")
        self.group = group
        self.steps = 0  # t
        self.mask = torch.full((rows, aligned(MIN_CAPACITY * group)), float("-inf"), dtype=dtype,
                               device=device)

    def add_step(self) -> None:
        """Step t: each row's own new key is key t * g + (its row in the group)."""
        B, g, t = self.mask.size(0), self.group, self.steps
        if (t + 1) * g > self.mask.size(1):  # full: twice the steps
            grown = self.mask.new_full((B, aligned(2 * (t + 1) * g)), float("-inf"))
            grown[:, :t * g] = self.mask[:, :t * g]
            self.mask = grown
        step = self.mask.view(B // g, g, self.mask.size(1))[:, :, t * g:(t + 1) * g]  # (B/g, g, g)
        step.diagonal(dim1=1, dim2=2).fill_(0.0)
        self.steps = t + 1

    def reorder(self, reorder: BeamReorder) -> bool:
        """Row i takes the ancestry of old row ``new_order[i]``. False when a row leaves its
        group: the caches then keep one history per row, and the ancestry is no longer used."""
        kept, _ = reorder.plan(self.group, self.mask.size(0) // self.group)
        if kept is None:
            return False
        self.mask = self.mask.index_select(0, reorder.new_order)
        return True

    def keys_mask(self, steps: int, dtype: torch.dtype) -> Tensor:
        """(B / g, 1, g, steps * g): the mask of the g queries of each group over its keys, in
        the keys' dtype (under autocast not the weights': converted once, then kept so)."""
        B, g = self.mask.size(0), self.group
        self._check(steps, steps == self.steps)
        if self.mask.dtype != dtype:
            self.mask = self.mask.to(dtype)
        return self.mask[:, :steps * g].view(B // g, 1, g, steps * g)

    def key_of_rows(self, steps: int) -> Tensor:
        """(B, steps): the index, within its group's keys, of each row's ancestor at each step
        (where the ancestry has its only 0 among -inf)."""
        B, g = self.mask.size(0), self.group
        self._check(steps, steps <= self.steps)  # (a cache may ungroup after the step is added)
        slot = self.mask[:, :steps * g].view(B, steps, g).argmax(-1)
        return torch.arange(steps, device=slot.device) * g + slot

    def _check(self, steps: int, consistent: bool) -> None:
        if not consistent:
            raise RuntimeError(f"a self-attention cache holds {steps} steps but the beam's "
                               f"ancestry {self.steps}: add_step must run once per step")


class KeyValueCache(ABC):
    """The interface both caches share. ``group``: rows (hypotheses) of one sentence that share
    storage, 1 when each row has its own."""

    group: int = 1

    @abstractmethod
    def append(self, k: Tensor, v: Tensor, mask: Optional[Tensor]) -> None:
        """Keep keys and values (rows, h, L, d_k): the source cache's one row per distinct row
        (``distinct_rows``, B / g), the self-attention cache's one row per hypothesis (B); and the
        mask (B, 1, 1, L), True where a key may be attended to (None: all)."""

    @abstractmethod
    def keys_values(self) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
        """Keys and values (B / g, h, S, d_k) for the g * T queries of each group, and their
        additive mask (0 where a query may attend, -inf elsewhere), broadcastable to
        (B / g, h, g * T, S), or None."""

    @abstractmethod
    def reorder(self, reorder: BeamReorder) -> None:
        """Follow beam search: row i continues row ``reorder.new_order[i]``."""

    @abstractmethod
    def own_keys_values(self) -> Tuple[Tensor, Tensor]:
        """Each row's own keys and values, (B, h, S, d_k), in the current order."""

    @abstractmethod
    def ungroup(self) -> None:
        """Switch to one row of storage per hypothesis (g = 1) from now on."""


class SourceAttentionCache(KeyValueCache):
    """The keys and values of the encoder output, projected once at the first step."""

    def __init__(self, group: int = 1):
        self.group = group
        self.k: Optional[Tensor] = None  # (B / g, h, S, d_k)
        self.v: Optional[Tensor] = None
        # (B / g, 1, 1, S'), S' = aligned(S): 0 at keys to attend, -inf elsewhere (and beyond S)
        self.mask: Optional[Tensor] = None

    def is_empty(self) -> bool:
        """Whether the source's keys and values are still to be projected (the first step)."""
        return self.k is None

    def distinct_rows(self, x: Tensor) -> Tensor:
        """The rows of a (B, ...) input whose keys and values this cache stores: one per group
        (the g rows of a group hold copies of one sentence)."""
        return x[:: self.group]

    def append(self, k: Tensor, v: Tensor, mask: Optional[Tensor]) -> None:
        # contiguous once here, or every step's matrix product copies the permuted heads
        self.k, self.v = k.contiguous(), v.contiguous()
        if mask is not None:  # as 0 / -inf to add to the scores: converted once, not every step
            real = self.distinct_rows(mask)  # (B / g, 1, 1, S), True at real tokens
            S = real.size(-1)
            mask = torch.full((*real.shape[:-1], aligned(S)), float("-inf"), dtype=k.dtype,
                              device=k.device)
            mask[..., :S].masked_fill_(real, 0.0)
        self.mask = mask

    def keys_values(self) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
        mask = None if self.mask is None else self.mask[..., :self.k.size(2)]
        return self.k, self.v, mask

    def reorder(self, reorder: BeamReorder) -> None:
        if self.k is None:
            return
        kept, moves = reorder.plan(self.group, self.k.size(0))
        if kept is None:  # a row leaves its group: one row per hypothesis
            self.ungroup()
            kept, moves = reorder.plan(1, self.k.size(0))
        if not moves:
            return  # every row kept its sentence: nothing moves
        self.k, self.v = self.k.index_select(0, kept), self.v.index_select(0, kept)
        if self.mask is not None:
            self.mask = self.mask.index_select(0, kept)

    def own_keys_values(self) -> Tuple[Tensor, Tensor]:
        return (self.k.repeat_interleave(self.group, 0),
                self.v.repeat_interleave(self.group, 0))

    def ungroup(self) -> None:
        if self.group == 1:
            return
        if self.k is not None:
            self.k, self.v = self.own_keys_values()
            if self.mask is not None:
                self.mask = self.mask.repeat_interleave(self.group, 0)
        self.group = 1


class SelfAttentionCache(KeyValueCache):
    """The keys and values (B, h, t, d_k) of the steps decoded so far (the decoder appends one
    step per call; a direct caller of MultiHeadedAttention may append several at once).

    With g > 1 (grouped) the storage is (B / g, h, C * g, d_k), read under the beam's ancestry
    (shared with the other layers); with g = 1 it is (B, h, C, d_k), and a pending reorder is
    applied as one row gather, into a spare buffer, before the next step is appended.
    """

    def __init__(self, group: int = 1, ancestry: Optional[Ancestry] = None):
        if group > 1 and (ancestry is None or ancestry.group != group):
            raise ValueError(f"a cache of groups of {group} rows needs their ancestry")
        self.group = group
        self.length = 0  # t
        self.k: Optional[Tensor] = None
        self.v: Optional[Tensor] = None
        self.ancestry = ancestry if group > 1 else None  # g > 1
        self.order: Optional[Tensor] = None  # g = 1: the reorder still to apply
        self.spare: Tuple[Optional[Tensor], Optional[Tensor]] = (None, None)  # g = 1

    def append(self, k: Tensor, v: Tensor, mask: Optional[Tensor] = None) -> None:
        """k, v (B, h, T, d_k), one row per hypothesis in the current order (grouped: the step
        already added to the ancestry). Incremental decoding attends to every earlier step, so
        there is no mask to keep."""
        if mask is not None:
            raise ValueError("the self-attention cache keeps no key mask: every earlier step "
                             "is visible to the next one")
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
        self.length = t + T

    def keys_values(self) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
        g, t = self.group, self.length
        k, v = self.k[:, :, :t * g], self.v[:, :, :t * g]
        if g == 1:
            return k, v, None  # (append applied any pending reorder)
        return k, v, self.ancestry.keys_mask(t, k.dtype)  # each of a group's g queries its own

    def reorder(self, reorder: BeamReorder) -> None:
        """Within groups only the ancestry changes (beam.py reorders it, once for every layer);
        otherwise rows are gathered (lazily)."""
        if self.k is None:
            return
        if self.group > 1:
            kept, moves = reorder.plan(self.group, self.k.size(0))
            if kept is not None:
                if moves:  # sentences finished
                    self.k, self.v = self.k.index_select(0, kept), self.v.index_select(0, kept)
                return
            self.ungroup()  # a row continues another sentence's hypothesis
        rows = self.k.size(0) if self.order is None else self.order.numel()
        kept, moves = reorder.plan(1, rows)
        if moves:
            self.order = kept if self.order is None else self.order.index_select(0, kept)

    def own_keys_values(self) -> Tuple[Tensor, Tensor]:
        g, t = self.group, self.length
        if g == 1:
            k, v = self.k[:, :, :t], self.v[:, :, :t]
            if self.order is not None:
                k, v = k.index_select(0, self.order), v.index_select(0, self.order)
            return k, v
        key = self.ancestry.key_of_rows(t)  # (B, t) index within the group's keys
        B = key.size(0)
        group = (torch.arange(B, device=key.device) // g)[:, None].expand(B, t)
        # advanced indices around a slice: (B, t, h, d_k) -> (B, h, t, d_k)
        return self.k[group, :, key].transpose(1, 2), self.v[group, :, key].transpose(1, 2)

    def ungroup(self) -> None:
        if self.group == 1:
            return
        rows = self.own_keys_values() if self.k is not None else None
        self.group, self.ancestry = 1, None
        if rows is not None:
            k, v = rows
            self._allocate(k, k.size(0), max(MIN_CAPACITY, self.length))
            self.k[:, :, :self.length], self.v[:, :, :self.length] = k, v

    def _allocate(self, like: Tensor, B: int, capacity: int) -> None:
        """Empty buffers for ``capacity`` steps of B rows (h, d_k, dtype, device of ``like``)."""
        g, h, d_k = self.group, like.size(1), like.size(-1)
        self.k = like.new_empty(B // g, h, capacity * g, d_k)
        self.v = like.new_empty(B // g, h, capacity * g, d_k)
        self.spare = (None, None)

    def _grow(self, capacity: int) -> None:
        used = self.length * self.group
        k, v = self.k, self.v
        self._allocate(k, k.size(0) * self.group, capacity)
        self.k[:, :, :used], self.v[:, :, :used] = k[:, :, :used], v[:, :, :used]

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
