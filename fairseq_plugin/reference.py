"""The Annotated Transformer, written plainly: read this first.

The notebook's model, class by class, in its structure and names, with no cache, no speed work
and no fairseq. The fairseq model (models/, modules/) computes the same things faster; the tests
load its weights into this one (reference_weights.py) and use it as the oracle it must agree
with, piece by piece and as a whole:

- ``attention``, ``MultiHeadedAttention``: scaled dot-product and multi-head attention;
- ``subsequent_mask``: what the decoder's self-attention may see;
- ``SublayerConnection``, ``PositionwiseFeedForward``, ``EncoderLayer``, ``DecoderLayer``,
  ``Encoder``, ``Decoder`` (built with ``clones``);
- ``Embeddings`` (x sqrt(d_model)), ``positional_encoding`` / ``PositionalEncoding``,
  ``Generator``;
- ``EncoderDecoder`` with ``encode`` / ``decode``, and ``make_model``;
- training as the notebook does it: ``Batch``, ``data_gen`` (the copy task), ``LabelSmoothing``,
  ``SimpleLossCompute``, ``rate`` (the Noam schedule) and ``run_epoch``;
- ``greedy_decode``.

Where this differs from the notebook, on purpose, and why (docs/code-map.md says more):

- ``nn.LayerNorm`` (the biased variance, eps 1e-5 inside the square root) instead of the
  notebook's hand-written norm (a_2 (x - mean) / (std + eps) + b_2 with the unbiased std, eps
  1e-6): the fairseq model uses torch's fused LayerNorm, as fairseq's transformer does, and the
  two must compute the same.
- The generator has no bias, so that its matrix can be tied to the embeddings
  (``--share-all-embeddings``, section 3.4's shared weights).
- Post-LN beside the notebook's pre-LN (``pre_ln=False``: the paper's LayerNorm(x +
  Sublayer(x)), no final norm), because the paper and fairseq's transformer use it.
- ``MultiHeadedAttention`` names its matrices ``w_q``, ``w_k``, ``w_v``, ``w_o`` instead of
  ``clones(nn.Linear(d_model, d_model), 4)``: each name says which matrix it is, and ``w_k`` /
  ``w_v`` may read a memory of another width than the decoder's. It returns the attention
  weights instead of keeping them in ``self.attn``: a module that keeps nothing from one call
  to the next (the heat-maps record the weights with a hook: modules/attention.py).
- Attention dropout is make_model's ``dropout``; the notebook's is 0.1 whatever ``dropout`` is.
  So make_model(dropout=0.0) is deterministic, as the fairseq model with ``--dropout 0`` is.
- ``LabelSmoothing``'s smoothing defaults to 0.1 (the paper's epsilon_ls; the notebook's default
  is 0.0, its examples pass it), and columns the smoothed target gives 0 add nothing even where
  the model gives them probability 0: the notebook's ``nn.KLDivLoss`` returns NaN there (0 times
  log 0; its label-smoothing loss figure is blank for that reason, harvardnlp/annotated-
  transformer#109).
- ``positional_encoding`` is computed in float64 (exact to more positions), then cast.
- No ``NoamOpt``: the notebook's current version, like this one, gives ``rate`` to torch's
  ``LambdaLR``. ``run_epoch`` keeps the notebook's loop but not its accumulation, logging and
  ``TrainState``.
- ``Batch``'s ``pad`` has no default (the notebook's 2 was its vocabulary's ``<blank>``): fairseq's
  dictionaries put padding at 1.

Shapes: B batch, T query length, S key length, h heads, d_k = d_model / h, V vocabulary.
"""

import copy
import math
from typing import Callable, Iterable, Iterator, Optional

import torch
from torch import Tensor, nn


def attention(query: Tensor, key: Tensor, value: Tensor, mask: Optional[Tensor] = None,
              dropout: Optional[nn.Module] = None):
    """Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V (section 3.2.1).

    query (..., T, d_k), key and value (..., S, d_k); mask broadcastable to (..., T, S), True
    (or 1) where a query may look. Returns the output (..., T, d_k) and the weights (..., T, S)
    (after dropout, as the notebook's).
    """
    scores = query @ key.transpose(-2, -1) / math.sqrt(query.size(-1))
    if mask is not None:
        scores = scores.masked_fill(mask == 0, -1e9)  # as the notebook (fp32 only)
    weights = scores.softmax(dim=-1)
    if dropout is not None:
        weights = dropout(weights)
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

    def __init__(self, h: int, d_model: int, dropout: float = 0.0,
                 d_memory: Optional[int] = None):
        super().__init__()
        self.h, self.d_k = h, d_model // h
        self.w_q = nn.Linear(d_model, d_model)
        self.w_k = nn.Linear(d_memory or d_model, d_model)
        self.w_v = nn.Linear(d_memory or d_model, d_model)
        self.w_o = nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, mask: Optional[Tensor] = None):
        """query (B, T, d_model), key and value (B, S, d_memory); mask (B or 1, T or 1, S).
        Returns (B, T, d_model) and the weights (B, h, T, S)."""
        B = query.size(0)

        def heads(x: Tensor) -> Tensor:  # (B, L, d_model) -> (B, h, L, d_k)
            return x.view(B, -1, self.h, self.d_k).transpose(1, 2)

        # 1) project and split into h heads
        q, k, v = heads(self.w_q(query)), heads(self.w_k(key)), heads(self.w_v(value))
        # 2) attend, the same mask for every head
        out, weights = attention(q, k, v, None if mask is None else mask.unsqueeze(1),
                                 self.dropout)
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
        """lprobs (N, V) log-probabilities of N tokens, target (N,) -> the summed KL divergence,
        sum q (log q - lprobs). A column where q is 0 adds 0 (0 log 0 = 0), also where lprobs is
        -inf (the notebook's KLDivLoss gives NaN there)."""
        q = self.target_distribution(target).to(lprobs.dtype)
        return nn.functional.kl_div(lprobs.masked_fill(q == 0, 0.0), q, reduction="sum")


class SublayerConnection(nn.Module):
    """A residual connection around a sub-layer, with its layer norm (section 3.1).

    The notebook's (pre-LN, "norm first"): x + Dropout(Sublayer(LayerNorm(x))); the paper's
    (post-LN): LayerNorm(x + Dropout(Sublayer(x))), dropout "to the output of each sub-layer,
    before it is added to the sub-layer input" (section 5.4)."""

    def __init__(self, size: int, dropout: float, pre_ln: bool = True):
        super().__init__()
        self.norm = nn.LayerNorm(size)
        self.dropout = nn.Dropout(dropout)
        self.pre_ln = pre_ln

    def forward(self, x: Tensor, sublayer: Callable[[Tensor], Tensor]) -> Tensor:
        if self.pre_ln:
            return x + self.dropout(sublayer(self.norm(x)))
        return self.norm(x + self.dropout(sublayer(x)))


class PositionwiseFeedForward(nn.Module):
    """FFN(x) = max(0, x W_1 + b_1) W_2 + b_2, at each position on its own (section 3.3)."""

    def __init__(self, d_model: int, d_ff: int, dropout: float = 0.1):
        super().__init__()
        self.w_1 = nn.Linear(d_model, d_ff)
        self.w_2 = nn.Linear(d_ff, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.w_2(self.dropout(self.w_1(x).relu()))


def clones(module: nn.Module, N: int) -> nn.ModuleList:
    """N identical layers (each its own copy of ``module``'s parameters)."""
    return nn.ModuleList([copy.deepcopy(module) for _ in range(N)])


class EncoderLayer(nn.Module):
    """Self-attention, then the feed-forward network, each a sub-layer (section 3.1)."""

    def __init__(self, size: int, self_attn: MultiHeadedAttention,
                 feed_forward: PositionwiseFeedForward, dropout: float, pre_ln: bool = True):
        super().__init__()
        self.size = size
        self.self_attn = self_attn
        self.feed_forward = feed_forward
        self.sublayer = clones(SublayerConnection(size, dropout, pre_ln), 2)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        """x (B, S, d_model), mask (B, 1, S)."""
        x = self.sublayer[0](x, lambda x: self.self_attn(x, x, x, mask)[0])
        return self.sublayer[1](x, self.feed_forward)


class Encoder(nn.Module):
    """A stack of N encoder layers; with pre-LN, a final LayerNorm after it."""

    def __init__(self, layer: EncoderLayer, N: int, pre_ln: bool = True):
        super().__init__()
        self.layers = clones(layer, N)
        self.norm = nn.LayerNorm(layer.size) if pre_ln else None

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x, mask)
        return x if self.norm is None else self.norm(x)


class DecoderLayer(nn.Module):
    """Self-attention, attention over the encoder's output ("memory"), then the feed-forward
    network (section 3.1)."""

    def __init__(self, size: int, self_attn: MultiHeadedAttention,
                 src_attn: MultiHeadedAttention, feed_forward: PositionwiseFeedForward,
                 dropout: float, pre_ln: bool = True):
        super().__init__()
        self.size = size
        self.self_attn = self_attn
        self.src_attn = src_attn
        self.feed_forward = feed_forward
        self.sublayer = clones(SublayerConnection(size, dropout, pre_ln), 3)

    def forward(self, x: Tensor, memory: Tensor, src_mask: Tensor, tgt_mask: Tensor) -> Tensor:
        """x (B, T, d_model), memory (B, S, d_memory), src_mask (B, 1, S), tgt_mask (B, T, T)."""
        m = memory
        x = self.sublayer[0](x, lambda x: self.self_attn(x, x, x, tgt_mask)[0])
        x = self.sublayer[1](x, lambda x: self.src_attn(x, m, m, src_mask)[0])
        return self.sublayer[2](x, self.feed_forward)


class Decoder(nn.Module):
    """A stack of N decoder layers; with pre-LN, a final LayerNorm after it."""

    def __init__(self, layer: DecoderLayer, N: int, pre_ln: bool = True):
        super().__init__()
        self.layers = clones(layer, N)
        self.norm = nn.LayerNorm(layer.size) if pre_ln else None

    def forward(self, x: Tensor, memory: Tensor, src_mask: Tensor, tgt_mask: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x, memory, src_mask, tgt_mask)
        return x if self.norm is None else self.norm(x)


class Embeddings(nn.Module):
    """Learned embeddings, multiplied by sqrt(d_model) (section 3.4)."""

    def __init__(self, d_model: int, vocab: int):
        super().__init__()
        self.lut = nn.Embedding(vocab, d_model)
        self.d_model = d_model

    def forward(self, x: Tensor) -> Tensor:  # (B, L) -> (B, L, d_model)
        return self.lut(x) * math.sqrt(self.d_model)


class PositionalEncoding(nn.Module):
    """Adds the sinusoids of ``positional_encoding`` to the embeddings, then dropout (sections
    3.5, 5.4). Positions count from the first column: the batch is padded on the right."""

    def __init__(self, d_model: int, dropout: float, max_len: int = 5000):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("pe", positional_encoding(max_len, d_model).float()[None],
                             persistent=False)  # (1, max_len, d_model)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(x + self.pe[:, : x.size(1)])


class Generator(nn.Module):
    """The linear projection to the vocabulary and the log-softmax (section 3.4)."""

    def __init__(self, d_model: int, vocab: int):
        super().__init__()
        self.proj = nn.Linear(d_model, vocab, bias=False)

    def forward(self, x: Tensor) -> Tensor:  # (B, L, d_model) -> (B, L, V) log-probabilities
        return self.proj(x).log_softmax(dim=-1)


class EncoderDecoder(nn.Module):
    """The standard encoder-decoder architecture: the encoder maps the source to a sequence of
    representations ("memory"), the decoder generates the target from it (section 3)."""

    def __init__(self, encoder: Encoder, decoder: Decoder, src_embed: nn.Module,
                 tgt_embed: nn.Module, generator: Generator):
        super().__init__()
        self.encoder = encoder
        self.decoder = decoder
        self.src_embed = src_embed
        self.tgt_embed = tgt_embed
        self.generator = generator

    def forward(self, src: Tensor, tgt: Tensor, src_mask: Tensor, tgt_mask: Tensor) -> Tensor:
        """The decoder's output (B, T, d_model); ``generator`` turns it into log-probabilities."""
        return self.decode(self.encode(src, src_mask), src_mask, tgt, tgt_mask)

    def encode(self, src: Tensor, src_mask: Tensor) -> Tensor:
        return self.encoder(self.src_embed(src), src_mask)

    def decode(self, memory: Tensor, src_mask: Tensor, tgt: Tensor, tgt_mask: Tensor) -> Tensor:
        return self.decoder(self.tgt_embed(tgt), memory, src_mask, tgt_mask)


def make_model(src_vocab: int, tgt_vocab: int, N: int = 6, d_model: int = 512, d_ff: int = 2048,
               h: int = 8, dropout: float = 0.1, pre_ln: bool = True) -> EncoderDecoder:
    """The full model from its hyper-parameters, then Glorot / fan_avg initialisation of every
    matrix."""
    c = copy.deepcopy
    attn = MultiHeadedAttention(h, d_model, dropout)
    ff = PositionwiseFeedForward(d_model, d_ff, dropout)
    position = PositionalEncoding(d_model, dropout)
    model = EncoderDecoder(
        Encoder(EncoderLayer(d_model, c(attn), c(ff), dropout, pre_ln), N, pre_ln),
        Decoder(DecoderLayer(d_model, c(attn), c(attn), c(ff), dropout, pre_ln), N, pre_ln),
        nn.Sequential(Embeddings(d_model, src_vocab), c(position)),
        nn.Sequential(Embeddings(d_model, tgt_vocab), c(position)),
        Generator(d_model, tgt_vocab))
    for p in model.parameters():
        if p.dim() > 1:
            nn.init.xavier_uniform_(p)
    return model


def rate(step: int, model_size: int, factor: float, warmup: int) -> float:
    """lrate = factor * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5) (section 5.3); step 0
    counts as step 1, so the rate is never infinite."""
    step = max(step, 1)
    return factor * model_size ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)


def src_mask_of(src: Tensor, pad: int) -> Tensor:
    """(B, S) -> (B, 1, S): True at real tokens."""
    return (src != pad).unsqueeze(-2)


def tgt_mask_of(tgt: Tensor, pad: int) -> Tensor:
    """(B, T) -> (B, T, T): real tokens, and no position after the query's (the notebook's
    Batch.make_std_mask)."""
    return (tgt != pad).unsqueeze(-2) & subsequent_mask(tgt.size(-1)).to(tgt.device)


@torch.no_grad()
def greedy_decode(model: EncoderDecoder, src: Tensor, src_mask: Tensor, max_len: int,
                  start_symbol: int) -> Tensor:
    """Encode once, then at every step run the decoder over the whole prefix and append the most
    probable next token. Returns (B, max_len) tokens, the start symbol first (fairseq starts
    every target with its end-of-sentence symbol)."""
    memory = model.encode(src, src_mask)
    ys = torch.full((src.size(0), 1), start_symbol, dtype=src.dtype, device=src.device)
    for _ in range(max_len - 1):
        out = model.decode(memory, src_mask, ys, subsequent_mask(ys.size(1)).to(src.device))
        prob = model.generator(out[:, -1])  # (B, V)
        ys = torch.cat([ys, prob.argmax(dim=-1, keepdim=True)], dim=1)
    return ys


class Batch:
    """A batch of sources and targets with their masks, as the model is trained on it (the
    notebook's "Batches and Masking"). ``tgt`` holds each target with its start symbol first:
    the decoder reads ``tgt`` without its last token and is taught to predict ``tgt_y``, the
    same tokens one step later ("teacher forcing"); fairseq calls them prev_output_tokens and
    target."""

    def __init__(self, src: Tensor, tgt: Optional[Tensor], pad: int):
        self.src = src  # (B, S)
        self.src_mask = src_mask_of(src, pad)  # (B, 1, S)
        if tgt is not None:
            self.tgt = tgt[:, :-1]  # (B, T): what the decoder reads
            self.tgt_y = tgt[:, 1:]  # (B, T): what it must predict at each position
            self.tgt_mask = tgt_mask_of(self.tgt, pad)  # (B, T, T)
            self.ntokens = int((self.tgt_y != pad).sum())  # the tokens the loss counts


def data_gen(V: int, batch_size: int, nbatches: int, length: int = 10,
             generator: Optional[torch.Generator] = None) -> Iterator[Batch]:
    """The notebook's first task: copy random symbols. ``nbatches`` batches of ``batch_size``
    sequences of ``length`` symbols drawn from 1 .. V - 1, the first set to 1 (the start
    symbol); the source is the target; 0 is padding (no sequence has any)."""
    for _ in range(nbatches):
        data = torch.randint(1, V, (batch_size, length), generator=generator)
        data[:, 0] = 1
        yield Batch(data, data.clone(), pad=0)


class SimpleLossCompute:
    """The generator, then the criterion over every position, divided by ``norm`` (the batch's
    tokens). Returns the summed loss as a number, and the normalised loss to differentiate."""

    def __init__(self, generator: Generator, criterion: LabelSmoothing):
        self.generator, self.criterion = generator, criterion

    def __call__(self, x: Tensor, y: Tensor, norm: int):
        lprobs = self.generator(x)  # (B, T, V)
        loss = self.criterion(lprobs.reshape(-1, lprobs.size(-1)), y.reshape(-1)) / norm
        return loss.item() * norm, loss


def run_epoch(data_iter: Iterable[Batch], model: EncoderDecoder, loss_compute: SimpleLossCompute,
              optimizer: Optional[torch.optim.Optimizer] = None,
              scheduler: Optional[torch.optim.lr_scheduler.LRScheduler] = None) -> float:
    """One pass over the batches: forward, the loss, and, with an optimizer, a gradient step and
    the schedule's next rate after each batch. Returns the loss per token."""
    total_loss, total_tokens = 0.0, 0
    for batch in data_iter:
        out = model(batch.src, batch.tgt, batch.src_mask, batch.tgt_mask)  # (B, T, d_model)
        loss, loss_node = loss_compute(out, batch.tgt_y, batch.ntokens)
        if optimizer is not None:
            loss_node.backward()
            optimizer.step()
            optimizer.zero_grad()
            if scheduler is not None:
                scheduler.step()
        total_loss += loss
        total_tokens += batch.ntokens
    return total_loss / total_tokens
