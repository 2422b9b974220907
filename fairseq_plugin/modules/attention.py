"""Multi-head attention, as in the Annotated Transformer, with fairseq's incremental state.

"An attention function can be described as mapping a query and a set of key-value pairs to an
output ... We compute the matrix of outputs as Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V."
(Vaswani et al. 2017, section 3.2.1)

"Multi-head attention allows the model to jointly attend to information from different
representation subspaces at different positions." MultiHead(Q, K, V) = Concat(head_1..head_h) W^O
(section 3.2.2)

Shapes: B batch, T query length, S key length, h heads, d_k = d_model / h.
"""

import contextlib
import math
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from fairseq.incremental_decoding_utils import with_incremental_state
from torch import Tensor, nn

from ..errors import PluginError
from .history import SelfAttentionHistory
from .packing import Packing

# Since torch 2.5, scaled_dot_product_attention returns zeros for a query whose mask allows no
# key; older versions return NaN there, so we zero such rows ourselves.
_SDPA_ZEROES_EMPTY_ROWS = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)


def check_heads_divide(d_model: int, heads: int, flag_prefix: str) -> None:
    """d_k = d_model / h must be a whole number."""
    if heads <= 0 or d_model % heads != 0:
        raise PluginError(
            f"--{flag_prefix}-embed-dim {d_model} is not divisible by "
            f"--{flag_prefix}-attention-heads {heads}; choose a number of heads that divides "
            f"the model dimension (e.g. {_a_divisor(d_model, heads)})"
        )


def _a_divisor(d_model: int, heads: int) -> int:
    return max((h for h in range(1, max(heads, 1) + 1) if d_model % h == 0), default=1)


def attention_reference(query, key, value, mask=None, dropout=None, bias=None):
    """The seed's formula written out: softmax(Q K^T / sqrt(d_k)) V with masked scores.

    query (B, h, T, d_k), key/value (B, h, S, d_k), mask broadcastable to (B, h, T, S) with
    True where a query may attend, or bias, added to the scores (0 or -inf). Scores are computed
    in fp32 and masked with -inf (not -1e9, which overflows fp16); a row with nothing to attend
    to gets all-zero weights.
    Returns output (B, h, T, d_k) in the input dtype and weights (B, h, T, S) in fp32.
    """
    d_k = query.size(-1)
    scores = torch.matmul(query.float(), key.float().transpose(-2, -1)) / math.sqrt(d_k)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if bias is not None:
        scores += bias
    p_attn = scores.softmax(dim=-1).nan_to_num(0.0)  # fully masked row: NaN -> 0
    p_used = dropout(p_attn) if dropout is not None else p_attn
    return torch.matmul(p_used.to(value.dtype), value), p_attn


def group_size(ids: Tensor) -> int:
    """g when ``ids`` is made of runs of g equal values, as beam search lays out the hypotheses
    of each sentence (B * beam rows, sentence by sentence); otherwise 1."""
    n = ids.numel()
    differs = (ids != ids[0]).nonzero()
    g = int(differs[0]) if differs.numel() else n
    if g <= 1 or n % g:
        return 1
    runs = ids.view(-1, g)
    return g if bool((runs == runs[:, :1]).all()) else 1


def causal_mask(query_len: int, key_len: int, device) -> Tensor:
    """(T, S) boolean, True where query i may attend to key j: j <= i + (S - T).

    "We ... modify the self-attention sub-layer in the decoder stack to prevent positions from
    attending to subsequent positions." (section 3.1) The offset S - T is the number of cached
    earlier positions during incremental decoding.
    """
    return torch.ones(query_len, key_len, dtype=torch.bool, device=device).tril(key_len - query_len)


@with_incremental_state
class MultiHeadedAttention(nn.Module):
    """Multi-head attention over h heads of size d_k = d_model / h.

    ``self_attention=True`` projects Q, K and V from one input with one fused matrix (the
    concatenation of W^Q, W^K, W^V, as in nanoGPT's ``c_attn``); during incremental decoding it
    caches K and V and appends one step at a time. Otherwise it is encoder-decoder attention:
    "the queries come from the previous decoder layer, and the memory keys and values come from
    the output of the encoder" (section 3.2.3); K and V are projected once per sentence and reused.
    """

    def __init__(self, heads: int, d_model: int, dropout: float = 0.0, self_attention: bool = True,
                 flag_prefix: str = "encoder", memory_dim: Optional[int] = None):
        super().__init__()
        check_heads_divide(d_model, heads, flag_prefix)
        self.h = heads
        self.d_k = d_model // heads
        self.self_attention = self_attention
        if self_attention:
            self.qkv_proj = nn.Linear(d_model, 3 * d_model)  # [W^Q; W^K; W^V]
        else:
            self.q_proj = nn.Linear(d_model, d_model)  # W^Q
            self.kv_proj = nn.Linear(memory_dim or d_model, 2 * d_model)  # [W^K; W^V]
        self.out_proj = nn.Linear(d_model, d_model)  # W^O
        self.dropout = nn.Dropout(dropout)  # on the attention probabilities
        self.recorded: Optional[list] = None  # set to a list to keep every weight matrix

    def _heads(self, x: Tensor, n: int):
        """(B, L, n * d_model) -> n tensors (B, h, L, d_k)."""
        B, L, _ = x.shape
        return x.view(B, L, n, self.h, self.d_k).permute(2, 0, 3, 1, 4).unbind(0)

    def forward(
        self,
        query: Tensor,
        memory: Optional[Tensor] = None,
        key_padding_mask: Optional[Tensor] = None,
        causal: bool = False,
        incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]] = None,
        need_weights: bool = False,
        memory_ids: Optional[Tensor] = None,
        packing: Optional[Packing] = None,
    ) -> Tuple[Tensor, Optional[Tensor]]:
        """query (B, T, d_model), or (N, d_model) packed by ``packing``; memory (B, S, d_model)
        for encoder-decoder attention; key_padding_mask (B, S), True at padding; memory_ids (B,)
        the sentence each row holds (lets beam search keep a sentence's K/V together, without
        copies). Returns (B, T, d_model) (or (N, d_model) packed) and, if need_weights, the
        attention weights (B, h, T, S)."""
        B, T = packing.shape if packing is not None else query.shape[:2]
        cache = (self.get_incremental_state(incremental_state, "kv")
                 if incremental_state is not None else None)
        group, bias = 1, None
        if self.self_attention:
            qkv = self.qkv_proj(query)
            q, k, v = self._heads(packing.unpack(qkv) if packing is not None else qkv, 3)
            if incremental_state is not None:
                if cache is None:  # keep each sentence's hypotheses together (history.py)
                    cache = SelfAttentionHistory(
                        group_size(memory_ids) if memory_ids is not None and T == 1
                        and key_padding_mask is None else 1)
                    self.set_incremental_state(incremental_state, "kv", cache)
                if need_weights or self.recorded is not None:
                    cache.ungroup()  # weights over each row's own history
                cache.append(k, v)
                # (B / group, h, t * group, d_k) and the ancestry mask when group > 1
                k, v, bias = cache.keys_values()
                group = cache.group
        else:
            q = self.q_proj(query)
            (q,) = self._heads(packing.unpack(q) if packing is not None else q, 1)
            if cache is not None:  # static K/V: projected at the first step
                k, v, group = cache["k"], cache["v"], cache["group"]
            else:
                # beam search repeats each sentence's memory `group` times: project it once
                group = (group_size(memory_ids)
                         if incremental_state is not None and memory_ids is not None else 1)
                k, v = self._heads(self.kv_proj(memory[::group]), 2)  # (B / group, h, S, d_k)
                if incremental_state is not None:
                    k, v = k.contiguous(), v.contiguous()  # or matmul copies them every step
                    ids = memory_ids if memory_ids is not None else torch.arange(
                        B, device=query.device)
                    self.set_incremental_state(
                        incremental_state, "kv", {"k": k, "v": v, "ids": ids, "group": group})
            if group > 1 and key_padding_mask is not None:
                key_padding_mask = key_padding_mask[::group]
        if group > 1:  # the group's queries attend together to their sentence's K/V
            q = q.reshape(B // group, group, self.h, T, self.d_k).transpose(1, 2)
            q = q.reshape(B // group, self.h, group * T, self.d_k)
        S = k.size(2)

        mask = None  # (B or 1, 1, T or 1, S), True = may attend
        if key_padding_mask is not None:
            mask = ~key_padding_mask[:, None, None, :]
        use_is_causal = False
        if causal and T > 1:
            if mask is None and S == T:
                use_is_causal = True
            else:
                cm = causal_mask(T, S, query.device)
                mask = cm if mask is None else mask & cm

        # The explicit formula gives the weights (alignments, heat-maps); it is also faster than
        # the fused kernel for the few queries per sentence of incremental decoding on CPU
        # (measured: 3.5 vs 10.5 ms for 850 hypotheses x 30 cached steps, d_model 256)
        decoding_on_cpu = incremental_state is not None and query.device.type == "cpu"
        if need_weights or self.recorded is not None or decoding_on_cpu:
            if use_is_causal:
                mask = causal_mask(T, S, query.device)
            out, weights = attention_reference(q, k, v, mask, self.dropout, bias)
            if not (need_weights or self.recorded is not None):
                weights = None
        else:
            weights = None
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask if bias is None else bias, is_causal=use_is_causal,
                dropout_p=self.dropout.p if self.training else 0.0)
            if mask is not None and not _SDPA_ZEROES_EMPTY_ROWS:
                out = out.masked_fill(~mask.any(-1, keepdim=True), 0.0)
        # "concatenated and once again projected" (B, h, T, d_k) -> (B, T, d_model); grouped
        # cross-attention: (B / group, h, group * T, d_k) -> (B, T, d_model) alike
        out = out.view(-1, self.h, B // out.size(0), T, self.d_k).permute(0, 2, 3, 1, 4)
        out = out.reshape(B, T, self.h * self.d_k)
        if packing is not None:
            out = packing.pack(out)
        if weights is not None:  # (B, h, T, S)
            weights = weights.view(-1, self.h, B // weights.size(0), T, S).transpose(1, 2)
            weights = weights.reshape(B, self.h, T, S)
            if self.recorded is not None:
                self.recorded.append(weights.detach())
        return self.out_proj(out), weights

    def reorder_incremental_state(self, incremental_state, new_order: Tensor):
        """Follow beam search: row i of the new cache is row new_order[i] of the old one.

        The self-attention history moves no keys when every row stays in its sentence's group
        (only the rows' ancestry masks are gathered, see history.py). The static encoder K/V is
        kept once per group of rows that hold the same sentence, so there is nothing to copy
        then either; when sentences finish and the batch shrinks, the groups' rows are selected.
        """
        cache = self.get_incremental_state(incremental_state, "kv")
        if cache is None:
            return incremental_state
        if self.self_attention:
            cache.reorder(new_order)
            return incremental_state
        new_ids = cache["ids"].index_select(0, new_order)
        if torch.equal(new_ids, cache["ids"]):  # every row keeps its sentence
            return incremental_state
        group = group_size(new_ids)
        # new group j reads the K/V row of old row new_order[j * group]
        rows = new_order[::group] // cache["group"]
        cache.update(k=cache["k"].index_select(0, rows), v=cache["v"].index_select(0, rows),
                     ids=new_ids, group=group)
        return self.set_incremental_state(incremental_state, "kv", cache)

    def cached_keys_values(self, incremental_state) -> Tuple[Tensor, Tensor]:
        """The keys and values the next step attends to, one row per hypothesis:
        (B, h, t, d_k) for self-attention, (B, h, S, d_k) for encoder-decoder attention."""
        cache = self.get_incremental_state(incremental_state, "kv")
        if self.self_attention:
            return cache.rows()
        rows = torch.arange(cache["ids"].numel()) // cache["group"]
        return cache["k"].index_select(0, rows), cache["v"].index_select(0, rows)


@contextlib.contextmanager
def recording_attention(model: nn.Module):
    """Keep the attention weights of every MultiHeadedAttention in ``model`` while inside:
    yields {module name: [weights (B, h, T, S) of each call]}."""
    modules = {name: m for name, m in model.named_modules() if isinstance(m, MultiHeadedAttention)}
    records = {}
    for name, m in modules.items():
        m.recorded = records[name] = []
    try:
        yield records
    finally:
        for m in modules.values():
            m.recorded = None
