from .attention import MultiHeadedAttention, explicit_attention, causal_mask  # noqa: F401
from .embeddings import (  # noqa: F401
    EmbeddingLayer,
    Embeddings,
    Generator,
    LearnedPositionalEncoding,
    SinusoidalPositionalEncoding,
)
from .layers import DecoderLayer, EncoderLayer, PositionwiseFeedForward, SublayerConnection  # noqa: F401
