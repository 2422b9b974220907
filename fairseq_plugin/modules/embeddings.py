"""Token embeddings, positional encodings and the generator (output projection).

Shapes: B batch, L length, V vocabulary, d_model model dimension.
"""

import math
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import PluginError
from .dropout import Dropout


class Embeddings(nn.Module):
    """"We use learned embeddings to convert the input tokens and output tokens to vectors of
    dimension d_model. ... In the embedding layers, we multiply those weights by sqrt(d_model)."
    (section 3.4)"""

    def __init__(self, d_model: int, vocab_size: int, padding_idx: int, scale: bool = True):
        super().__init__()
        self.lut = nn.Embedding(vocab_size, d_model, padding_idx=padding_idx)
        self.factor = math.sqrt(d_model) if scale else 1.0  # or 1: --no-scale-embedding

    def forward(self, tokens: Tensor) -> Tensor:  # (B, L) -> (B, L, d_model)
        return self.lut(tokens) * self.factor


def positions_of(tokens: Tensor, padding_idx: int) -> Tensor:
    """Position of each token among the non-padding tokens of its row, from 0.

    Counting only real tokens makes a sentence's encoding independent of how its batch is
    padded (fairseq left-pads sources, in training and generation, and right-pads targets).
    (B, L) -> (B, L)
    """
    real = tokens.ne(padding_idx)
    return (torch.cumsum(real, dim=1) - 1).clamp_(min=0)


def sinusoid_table(rows: int, d_model: int) -> Tensor:
    """The notebook's PositionalEncoding table, (rows, d_model) in fp32: sin in the even
    columns, cos in the odd ones (for an odd d_model, one cos column fewer)."""
    position = torch.arange(rows, dtype=torch.float32).unsqueeze(1)  # (rows, 1)
    div_term = torch.exp(  # 1 / 10000^(2i/d_model), (ceil(d_model / 2),)
        torch.arange(0, d_model, 2, dtype=torch.float32) * -(math.log(10000.0) / d_model))
    pe = torch.zeros(rows, d_model)
    pe[:, 0::2] = torch.sin(position * div_term)
    pe[:, 1::2] = torch.cos(position * div_term[: d_model // 2])
    return pe


class SinusoidalPositionalEncoding(nn.Module):
    """PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d_model)).

    "We chose the sinusoidal version because it may allow the model to extrapolate to sequence
    lengths longer than the ones encountered during training." (section 3.5)
    The table is a plain cached tensor, not a buffer: nothing to save in checkpoints or to
    broadcast between distributed ranks. It has max_positions rows, more when a decoding step
    asks for a later position (as fairseq's transformer, e.g. under --match-source-len).
    """

    def __init__(self, d_model: int, max_positions: int):
        super().__init__()
        self.d_model = d_model
        self.max_positions = max_positions
        self._table: Optional[Tensor] = None

    def table(self, dtype, device, rows: int = 0) -> Tensor:  # (at least max_positions and rows, d)
        t = self._table
        if t is None or t.device != device or t.dtype != dtype or t.size(0) < rows:
            grown = 0 if t is None or t.size(0) >= rows else 2 * t.size(0)  # past the limit
            rows = max(self.max_positions, rows, grown)
            t = self._table = sinusoid_table(rows, self.d_model).to(device=device, dtype=dtype)
        return t

    def forward(self, positions: Union[Tensor, int], like: Tensor) -> Tensor:
        """(B, L) positions -> (B, L, d); one position p for every row -> (d,), row p; in the
        dtype and on the device of ``like``, the embeddings they are added to."""
        if isinstance(positions, int):
            return self.table(like.dtype, like.device, positions + 1)[positions]
        return F.embedding(positions, self.table(like.dtype, like.device))


class LearnedPositionalEncoding(nn.Module):
    """Learned position embeddings, the alternative of section 3.5 ("nearly identical results")."""

    def __init__(self, d_model: int, max_positions: int):
        super().__init__()
        self.max_positions = max_positions
        self.embed = nn.Embedding(max_positions, d_model)

    def forward(self, positions: Union[Tensor, int], like: Tensor) -> Tensor:
        """(B, L) positions -> (B, L, d); one position p for every row -> (d,), row p; in the
        dtype of ``like``, the embeddings they are added to."""
        if isinstance(positions, int):
            return self.embed.weight[positions].to(like.dtype)
        return self.embed(positions).to(like.dtype)


class EmbeddingLayer(nn.Module):
    """Embeddings plus positional encodings, then dropout.

    "We apply dropout to the sums of the embeddings and the positional encodings in both the
    encoder and decoder stacks." (section 5.4)
    """

    def __init__(self, embeddings: Embeddings, positional: Optional[nn.Module], dropout: float,
                 side: str, max_positions: int):
        super().__init__()
        self.embeddings = embeddings
        self.positional = positional
        self.dropout = Dropout(dropout, type(self).__name__)
        self.side = side  # "source" or "target", for error messages
        # the longest sentence (--max-source/target-positions), with positional encodings or not
        self.max_positions = max_positions

    def positions(self, tokens: Tensor) -> Tensor:
        """Each token's position among its row's real tokens (``positions_of``), (B, L) -> (B, L);
        a row with more real tokens than ``max_positions`` is an error."""
        positions = positions_of(tokens, self.embeddings.lut.padding_idx)
        # a row of L tokens has positions below L: only a longer row can exceed the limit, and
        # only then is the device read
        if tokens.size(1) > self.max_positions and positions.numel():
            self._check_length(int(positions.max()) + 1)
        return positions

    def step_position(self, prefix: Tensor) -> int:
        """The position of a decoding step's new token, the last of ``prefix`` (B, T): T - 1 in
        every row, as beam search's prefixes hold no padding (which the cached keys assume too).
        One number instead of ``positions``: the step adds a row of the table and launches
        nothing to find it. Beam search may decode past max_positions (--match-source-len does
        not cap the length): sinusoids are computed for any position (and without positional
        encodings there is nothing to compute), a learned table ends. (A full pass refuses a
        sentence over the limit: ``positions``.)"""
        step = prefix.size(1) - 1
        if step >= self.max_positions and isinstance(self.positional, LearnedPositionalEncoding):
            raise PluginError(
                f"a {self.side} of {step + 1} tokens is past this model's {self.max_positions} "
                f"learned positions (--max-target-positions); beam search goes past them only "
                f"under --match-source-len: give it sources shorter than {self.max_positions} "
                f"tokens")
        return step

    def _check_length(self, tokens: int) -> None:
        if tokens > self.max_positions:
            flag = "--max-source-positions" if self.side == "source" else "--max-target-positions"
            raise PluginError(
                f"a {self.side} sentence has {tokens} tokens but this model allows at most "
                f"{self.max_positions} ({flag}); shorten or split the sentence, or skip such "
                f"inputs with --skip-invalid-size-inputs-valid-test")

    def forward(self, tokens: Tensor, positions: Union[Tensor, int, None] = None) -> Tensor:
        """tokens (B, L) -> (B, L, d_model); ``positions``: (B, L), or one for all rows (a
        decoding step's ``step_position``), or None for ``self.positions(tokens)``."""
        if positions is None:
            positions = self.positions(tokens)  # (also refuses a sentence over max_positions)
        x = self.embeddings(tokens)
        if self.positional is not None:
            x = x + self.positional(positions, like=x)
        return self.dropout(x)


class Generator(nn.Module):
    """"We also use the usual learned linear transformation and softmax function to convert the
    decoder output to predicted next-token probabilities." (section 3.4)

    The weight can be shared with the target embeddings ("we share the same weight matrix between
    the two embedding layers and the pre-softmax linear transformation"). The softmax itself is
    fairseq's ``get_normalized_probs`` (log-softmax in fp32). Unlike the notebook's
    ``nn.Linear(d_model, vocab)`` the projection has no bias, as the shared embedding matrix has
    none (and as fairseq's transformer).
    """

    def __init__(self, d_model: int, vocab_size: int, shared_weight: Optional[nn.Parameter] = None):
        super().__init__()
        self.proj = nn.Linear(d_model, vocab_size, bias=False)
        if shared_weight is not None:
            self.proj.weight = shared_weight

    def forward(self, x: Tensor) -> Tensor:  # (B, L, d_model) -> (B, L, V) logits
        return self.proj(x)
