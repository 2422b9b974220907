"""Decoding without a cache: every step re-runs the decoder over the whole prefix.

For comparison only (tests prove the cache changes nothing; the benchmark measures what it
saves). Wrapping a model's decoder in :class:`PrefixRecomputingDecoder` hides
``incremental_state`` from fairseq's SequenceGenerator, which then passes the full prefix at
every step. Like the notebook's greedy decoding it sends only the newest position through the
generator, and it computes no attention weights: the fair baseline for the cache. Its full passes
refuse sentences over the position limits, which cached steps with sinusoids may pass
(--match-source-len).
"""

from fairseq.models import FairseqDecoder, FairseqEncoderDecoderModel


class PrefixRecomputingDecoder(FairseqDecoder):
    def __init__(self, inner):
        super().__init__(inner.dictionary)
        self.inner = inner

    def forward(self, prev_output_tokens, encoder_out=None, **unused):
        """prev_output_tokens (B, t) -> logits of the newest position (B, 1, V)."""
        need_attn, self.inner.need_attn = self.inner.need_attn, False
        try:
            features, _ = self.inner.extract_features(prev_output_tokens, encoder_out)
        finally:
            self.inner.need_attn = need_attn
        return self.inner.output_layer(features[:, -1:]), {"attn": [None]}

    def max_positions(self):
        return self.inner.max_positions()


def without_cache(model):
    """The same model (shared weights) decoding without incremental state."""
    return FairseqEncoderDecoderModel(model.encoder, PrefixRecomputingDecoder(model.decoder)).eval()


def cached_rows(attention, incremental_state):
    """Each hypothesis's own cached keys and values (B, h, S, d_k) of one attention module."""
    return attention.cache(incremental_state).own_keys_values()
