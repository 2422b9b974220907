"""The Annotated Transformer's pieces, written plainly: read these first.

Each function or class here is one concept of the notebook, as short as it can be, with no
cache and no speed work, and (but for ``greedy_decode``, which drives a fairseq_plugin model) no
fairseq. The fairseq model (models/, modules/) computes the same things faster; the tests use
these as the oracle it must agree with:

- ``attention`` and ``MultiHeadedAttention``: scaled dot-product and multi-head attention;
- ``subsequent_mask``: what the decoder's self-attention may see;
- ``positional_encoding``: the sinusoids added to the embeddings;
- ``LabelSmoothing``: the smoothed target distribution and its KL divergence;
- ``greedy_decode``: decoding one token at a time by re-running the decoder over the prefix.

No dropout: the notebook's ``attention(..., dropout)`` and ``MultiHeadedAttention(..., dropout)``
take one, but the tests compare in evaluation mode, where it does nothing.

Shapes: B batch, T query length, S key length, h heads, d_k = d_model / h, V vocabulary.
"""

import math
from typing import Optional

import torch
from torch import Tensor, nn


def attention(query: Tensor, key: Tensor, value: Tensor, mask: Optional[Tensor] = None):
    """Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V (section 3.2.1).

    query (..., T, d_k), key and value (..., S, d_k); mask broadcastable to (..., T, S), True
    (or 1) where a query may look. Returns the output (..., T, d_k) and the weights (..., T, S).
    """
    scores = query @ key.transpose(-2, -1) / math.sqrt(query.size(-1))
    if mask is not None:
        scores = scores.masked_fill(mask == 0, -1e9)  # as the notebook (fp32 only)
    weights = scores.softmax(dim=-1)
    return weights @ value, weights


def subsequent_mask(size: int) -> Tensor:
    """(1, size, size), True where position i may attend to position j: j <= i (section 3.1)."""
    return torch.ones(1, size, size, dtype=torch.bool).tril()


def positional_encoding(length: int, d_model: int) -> Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i / d_model)), PE(pos, 2i + 1) = cos(the same) (section
    3.5), for positions 0 .. length - 1: (length, d_model), in float64."""
    pos = torch.arange(length, dtype=torch.float64)[:, None]  # (length, 1)
    two_i = torch.arange(0, d_model, 2, dtype=torch.float64)  # (d_model / 2,)
    angle = pos / 10000 ** (two_i / d_model)  # (length, d_model / 2)
    pe = torch.empty(length, d_model, dtype=torch.float64)
    pe[:, 0::2], pe[:, 1::2] = angle.sin(), angle.cos()
    return pe


class MultiHeadedAttention(nn.Module):
    """MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O, head_i = Attention(Q W^Q_i, K W^K_i,
    V W^V_i) (section 3.2.2), with four separate matrices (W^K and W^V read d_memory-wide inputs
    when the encoder's width differs from the decoder's)."""

    def __init__(self, h: int, d_model: int, d_memory: Optional[int] = None):
        super().__init__()
        self.h, self.d_k = h, d_model // h
        self.w_q = nn.Linear(d_model, d_model)
        self.w_k = nn.Linear(d_memory or d_model, d_model)
        self.w_v = nn.Linear(d_memory or d_model, d_model)
        self.w_o = nn.Linear(d_model, d_model)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, mask: Optional[Tensor] = None):
        """query (B, T, d_model), key and value (B, S, d_memory); mask (B or 1, T or 1, S).
        Returns (B, T, d_model) and the weights (B, h, T, S)."""
        B = query.size(0)

        def heads(x: Tensor) -> Tensor:  # (B, L, d_model) -> (B, h, L, d_k)
            return x.view(B, -1, self.h, self.d_k).transpose(1, 2)

        # 1) project and split into h heads
        q, k, v = heads(self.w_q(query)), heads(self.w_k(key)), heads(self.w_v(value))
        # 2) attend, the same mask for every head
        out, weights = attention(q, k, v, None if mask is None else mask.unsqueeze(1))
        # 3) concatenate the heads and apply W^O
        return self.w_o(out.transpose(1, 2).reshape(B, -1, self.h * self.d_k)), weights


class LabelSmoothing(nn.Module):
    """KL divergence between the model's log-probabilities and a smoothed target (section 5.4):
    1 - eps on the gold token, eps spread evenly over every other token but padding, padding 0,
    and nothing at all for a padding target."""

    def __init__(self, vocab_size: int, padding_idx: int, smoothing: float = 0.1):
        super().__init__()
        self.vocab_size, self.padding_idx, self.smoothing = vocab_size, padding_idx, smoothing

    def target_distribution(self, target: Tensor) -> Tensor:
        """target (N,) tokens -> (N, V)"""
        dist = torch.full((target.numel(), self.vocab_size), self.smoothing / (self.vocab_size - 2),
                          device=target.device)
        dist.scatter_(1, target[:, None], 1.0 - self.smoothing)
        dist[:, self.padding_idx] = 0.0
        dist[target == self.padding_idx] = 0.0
        return dist

    def forward(self, lprobs: Tensor, target: Tensor) -> Tensor:
        """lprobs (N, V) log-probabilities of N tokens, target (N,) -> the summed KL divergence."""
        q = self.target_distribution(target).to(lprobs.dtype)
        return nn.functional.kl_div(lprobs, q, reduction="sum")


@torch.no_grad()
def greedy_decode(model, src_tokens: Tensor, src_lengths: Tensor, max_len: int) -> Tensor:
    """The notebook's greedy decoding for a fairseq_plugin model: encode once, then at every step
    run the decoder over the whole prefix and pick the most probable next token, projecting only
    the newest position. fairseq starts every target with eos. Returns (B, max_len) tokens."""
    encoder_out = model.encoder(src_tokens, src_lengths)
    ys = src_tokens.new_full((src_tokens.size(0), 1), model.decoder.dictionary.eos())
    for _ in range(max_len):
        features, _ = model.decoder.extract_features(ys, encoder_out)  # (B, t, d_model)
        logits = model.decoder.output_layer(features[:, -1])  # (B, V)
        ys = torch.cat([ys, logits.argmax(-1, keepdim=True)], dim=1)
    return ys[:, 1:]
