"""Beam search's state in one place: what the model keeps so that beam search's reorders copy
as little as possible (the speed work of cache.py, behind one small interface).

fairseq's SequenceGenerator keeps ``beam_size`` hypotheses per sentence in consecutive rows and
after every step tells the model how they continue: row i continues row ``new_order[i]``. It
reorders the encoder output (``reorder_encoder_out``) and the decoder's incremental state
(``reorder_incremental_state``) with the same tensor. The notebook's ``greedy_decode`` has none
of this; fairseq's transformer copies every row of every cache at every step.

One ``BeamSearchState`` per model, shared by its encoder and its decoder (``make_model``), holds:

- the beam size, which SequenceGenerator hands the model (``set_beam_size``);
- the answers of the latest reorder (``ReorderPlans``): worked out once per step, then followed
  by the encoder output and by every cache;
- in each decoding's ``incremental_state``, the beam's ``Ancestry``: which of its group's keys
  each hypothesis descends from, one for every self-attention cache.

The encoder and the decoder reach it through three calls:

- ``reorder_encoder_out(encoder_out, new_order)`` (the encoder's): the beam's copies of a
  sentence are recorded as a group (``"beam_group"``) and not copied again;
- ``begin_step(incremental_state, encoder_out, attentions, rows)`` (the decoder's, before each
  decoding step): empty caches at the first step, grouped as the encoder output is; then the new
  step in the ancestry;
- ``reorder(incremental_state, attentions, new_order)`` (the decoder's, once per step): every
  cache and the ancestry follow beam search.

Attention modules only keep their cache (``cache`` and ``set_cache``); which kind of cache, its
group and its ancestry are decided here.
"""

from typing import Dict, List, Optional

import torch
from fairseq.incremental_decoding_utils import FairseqIncrementalState
from torch import Tensor

from .cache import (Ancestry, BeamReorder, ReorderPlans, SelfAttentionCache, SourceAttentionCache,
                    repeats_rows)

EncoderOut = Dict[str, List[Tensor]]


def beam_group(encoder_out: EncoderOut) -> int:
    """g when the rows of encoder_out come in groups of g copies of one sentence (beam search),
    else 1."""
    group = encoder_out.get("beam_group")
    return int(group[0]) if group else 1


def reorder_encoder_rows(encoder_out: EncoderOut, reorder: BeamReorder,
                         beam_size: int) -> EncoderOut:
    """The encoder output with row i taken from row new_order[i].

    Beam search first repeats every sentence beam_size times, in consecutive rows: those rows
    are copies, which ``"beam_group": [g]`` records. Its later reorders keep every hypothesis in
    its sentence's group, so they change nothing here and copy nothing; when sentences finish,
    their groups are dropped.
    """
    group = beam_group(encoder_out)
    rows = encoder_out["encoder_out"][0].size(0) // group
    new_order = reorder.new_order
    kept, moves = reorder.plan(group, rows)  # (shared with the decoder's: ReorderPlans)
    if not moves:
        return encoder_out
    reordered = {key: [t.index_select(0, new_order) for t in value]
                 for key, value in encoder_out.items() if key != "beam_group"}
    # not grouped yet, or a row left its group: grouped from now on only when this reorder
    # makes groups of beam_size copies of one row (beam search's first reorder does)
    if kept is None or group == 1:
        group = beam_size if repeats_rows(new_order, beam_size) else 1
    reordered["beam_group"] = [torch.tensor(group)] if group > 1 else []
    return reordered


class BeamSearchState(FairseqIncrementalState):
    """The model's one owner of beam-search state (this module's docstring). ``attentions``: the
    decoder's MultiHeadedAttention modules, each keeping its cache in ``incremental_state``."""

    def __init__(self):
        super().__init__()  # a key of its own in each decoding's incremental_state
        self.size = 1  # the beam size: set by fairseq's SequenceGenerator, through the model
        self.plans = ReorderPlans()

    def reorder_encoder_out(self, encoder_out: EncoderOut, new_order: Tensor) -> EncoderOut:
        """Row i of the result is row new_order[i] of encoder_out."""
        return reorder_encoder_rows(encoder_out, self.plans.reorder(new_order), self.size)

    def begin_step(self, incremental_state, encoder_out: EncoderOut, attentions: list,
                   rows: int) -> None:
        """Before each decoding step of ``rows`` hypotheses: empty caches at the first, then the
        new step in the beam's ancestry."""
        if attentions[0].cache(incremental_state) is None:
            self.start_caches(incremental_state, beam_group(encoder_out), attentions, rows)
        ancestry = self.ancestry(incremental_state)
        if ancestry is not None:
            ancestry.add_step()

    def start_caches(self, incremental_state, group: int, attentions: list, rows: int) -> None:
        """Empty caches for every attention module. When the encoder output holds its sentences in
        groups of ``group`` copies (the beam), each group shares storage, and the self-attention
        caches share one ancestry of the hypotheses (cache.py)."""
        ancestry = None
        if group > 1:
            like = next(attentions[0].parameters())
            ancestry = Ancestry(rows, group, like.dtype, like.device)
            self.set_incremental_state(incremental_state, "ancestry", ancestry)
        for attention in attentions:
            cache = (SelfAttentionCache(group, ancestry) if attention.self_attention
                     else SourceAttentionCache(group))
            attention.set_cache(incremental_state, cache)

    def reorder(self, incremental_state, attentions: list, new_order: Tensor) -> None:
        """Beam search's reorder, once per step: worked out once (BeamReorder), then followed by
        every cache and by the beam's ancestry while a cache reads it."""
        reorder = self.plans.reorder(new_order)
        caches = [attention.cache(incremental_state) for attention in attentions]
        for cache in caches:
            if cache is not None:
                cache.reorder(reorder)
        ancestry = self.ancestry(incremental_state)
        if ancestry is None:
            return
        read = any(isinstance(cache, SelfAttentionCache) and cache.ancestry is ancestry
                   for cache in caches)  # not when every cache ungrouped (attention weights)
        if not read or not ancestry.reorder(reorder):
            self.set_incremental_state(incremental_state, "ancestry", None)  # no groups any more

    def ancestry(self, incremental_state) -> Optional[Ancestry]:
        """The beam's ancestry in this decoding, None while its caches keep a row per hypothesis."""
        return self.get_incremental_state(incremental_state, "ancestry")
