"""The decoding cache (fairseq_plugin/modules/cache.py) on its own: a beam's self-attention
history, kept once per group of rows, equals each row's own history through beam search's
reorders, growth and shrinking, and moves no keys while rows stay in their groups. (Decoding
through it, against a full pass: test_incremental_decoding.py.)"""

import pytest
import torch

from fairseq_plugin.modules.attention import explicit_attention
from fairseq_plugin.modules.cache import (Ancestry, BeamReorder, SelfAttentionCache,
                                          SourceAttentionCache, plan_reorder)
from fairseq_plugin.testing.operations import OperationCounter


def naive_history_test_steps(group, steps, cross_group_at=None, shrink_at=None, seed=0):
    """Append random steps to a SelfAttentionCache and to plain per-row tensors, reordering
    both as beam search does; returns (history, reference keys (B, h, t, d_k), values)."""
    g = torch.Generator().manual_seed(seed)
    sentences, h, d_k = 3, 2, 4
    B = sentences * group
    ancestry = Ancestry(B, group, torch.float32, "cpu") if group > 1 else None
    history = SelfAttentionCache(group, ancestry)
    ref_k = torch.zeros(B, h, 0, d_k)
    ref_v = torch.zeros(B, h, 0, d_k)
    for step in range(steps):
        k, v = torch.randn(B, h, 1, d_k, generator=g), torch.randn(B, h, 1, d_k, generator=g)
        if ancestry is not None:  # as the decoder does
            ancestry.add_step()
        history.append(k, v)
        ref_k, ref_v = torch.cat([ref_k, k], 2), torch.cat([ref_v, v], 2)
        n = B // group
        new_order = (torch.arange(n)[:, None] * group
                     + torch.randint(0, group, (n, group), generator=g)).view(-1)
        if step == cross_group_at:  # a row takes another sentence's hypothesis
            new_order[0] = B - 1
        if step == shrink_at and n > 1:  # the middle sentence finishes
            new_order = torch.cat([new_order[:group], new_order[2 * group:]])
            B -= group
        reorder = BeamReorder(new_order)
        history.reorder(reorder)
        if ancestry is not None and not ancestry.reorder(reorder):
            ancestry = None
        ref_k, ref_v = ref_k.index_select(0, new_order), ref_v.index_select(0, new_order)
    return history, ref_k, ref_v


@pytest.mark.parametrize("group", [1, 4])
def test_history_rows_equal_per_row_histories_through_reorders_growth_and_shrinking(group):
    history, ref_k, ref_v = naive_history_test_steps(group, steps=40, shrink_at=20)
    assert history.length == 40 and history.group == group  # grew past its first capacity
    k, v = history.own_keys_values()
    assert torch.equal(k, ref_k) and torch.equal(v, ref_v)


def test_history_reorder_within_groups_moves_no_keys():
    history, _, _ = naive_history_test_steps(4, steps=5)
    used = history.length * history.group  # keys stored (the rest of the buffer is unwritten)
    keys, stored = history.k.data_ptr(), (history.k[:, :, :used].clone(),
                                          history.v[:, :, :used].clone())
    new_order = torch.tensor([3, 3, 0, 1, 4, 5, 6, 7, 11, 8, 8, 8])
    with OperationCounter() as reorder:
        history.reorder(BeamReorder(new_order))
    with OperationCounter() as deciding:
        plan_reorder(new_order, 4, 3)
    # it decides that rows stay in their groups, and does nothing else (no copy, even in place)
    assert reorder.launches == deciding.launches
    assert history.k.data_ptr() == keys and history.group == 4
    assert torch.equal(history.k[:, :, :used], stored[0])
    assert torch.equal(history.v[:, :, :used], stored[1])
    history.append(torch.zeros(12, 2, 1, 4), torch.zeros(12, 2, 1, 4))
    assert history.k.data_ptr() == keys  # the new step is written in place


def test_history_reorder_across_sentences_falls_back_to_one_history_per_row():
    history, ref_k, ref_v = naive_history_test_steps(4, steps=6, cross_group_at=3)
    assert history.group == 1
    k, v = history.own_keys_values()
    assert torch.equal(k, ref_k) and torch.equal(v, ref_v)


@pytest.mark.parametrize("group", [1, 4])
def test_a_reorder_before_the_first_step_leaves_empty_caches_empty(group):
    """A direct caller may reorder before anything is cached: nothing to move, and the first
    step is then stored for the rows as given."""
    B, h, d_k = 8, 2, 4
    ancestry = Ancestry(B, group, torch.float32, "cpu") if group > 1 else None
    history, source = SelfAttentionCache(group, ancestry), SourceAttentionCache(group)
    reorder = BeamReorder(torch.arange(B).flip(0))
    history.reorder(reorder)
    source.reorder(reorder)
    assert history.k is None and history.order is None and source.is_empty()
    k, v = torch.randn(B, h, 1, d_k), torch.randn(B, h, 1, d_k)
    if ancestry is not None:
        ancestry.add_step()
    history.append(k, v)
    source.append(source.distinct_rows(k), source.distinct_rows(v), None)
    assert torch.equal(history.own_keys_values()[0], k)
    assert torch.equal(history.own_keys_values()[1], v)
    assert torch.equal(source.own_keys_values()[0], k[::group].repeat_interleave(group, 0))


def test_grouped_history_attention_equals_attention_over_each_rows_own_history():
    """What a query computes from the group's keys under the ancestry mask is what it computes
    from its own history alone."""
    history, ref_k, ref_v = naive_history_test_steps(4, steps=7)
    k, v, bias = history.keys_values()  # (3, 2, 28, 4), mask (3, 1, 4, 28)
    q = torch.randn(12, 2, 1, 4)
    grouped = q.view(3, 4, 2, 4).transpose(1, 2)  # the 4 queries of each group together
    out, _ = explicit_attention(grouped, k, v, bias)
    expected, _ = explicit_attention(q, ref_k, ref_v)
    assert torch.allclose(out.transpose(1, 2).reshape(12, 2, 1, 4), expected, atol=1e-6)
