"""Decoding without a cache, the seeds' way: every step re-runs the decoder over the whole prefix.

Only for comparison (tests prove the cache changes nothing; the benchmark measures what it saves).
Wrapping a model's decoder in :class:`PrefixRecomputingDecoder` hides ``incremental_state`` from
fairseq's SequenceGenerator, which then passes the full prefix at every step.
"""

from fairseq.models import FairseqDecoder, FairseqEncoderDecoderModel


class PrefixRecomputingDecoder(FairseqDecoder):
    def __init__(self, inner):
        super().__init__(inner.dictionary)
        self.inner = inner

    def forward(self, prev_output_tokens, encoder_out=None, **unused):
        return self.inner(prev_output_tokens, encoder_out=encoder_out)

    def max_positions(self):
        return self.inner.max_positions()


def without_cache(model):
    """The same model (shared weights) decoding without incremental state."""
    return FairseqEncoderDecoderModel(model.encoder, PrefixRecomputingDecoder(model.decoder)).eval()
