"""fp16 / bf16: no inf or NaN with padded batches, outputs close to fp32."""

import pytest
import torch

from conftest import CPU_HALF_DTYPES, build_tiny_model, make_dictionary, padded_batch
from fairseq_plugin.criterions.annotated_label_smoothing import annotated_label_smoothing_loss


# left-padded sources, one of them all padding but its end-of-sentence token; a shorter target
SRC_LENGTHS, TGT_LENGTHS = (9, 4, 9, 1), (7, 7, 4, 7)


@pytest.mark.parametrize("dtype", CPU_HALF_DTYPES)
def test_half_precision_model_gives_finite_outputs_close_to_fp32(dtype):
    d = make_dictionary(50)
    model = build_tiny_model(d)
    src, lengths, prev, tgt = padded_batch(d, SRC_LENGTHS, TGT_LENGTHS)
    with torch.no_grad():
        ref = model.get_normalized_probs(model(src, lengths, prev), log_probs=True)
        model = model.to(dtype)
        net_output = model(src, lengths, prev)
        lprobs = model.get_normalized_probs(net_output, log_probs=True)
    assert net_output[0].dtype == dtype
    assert torch.isfinite(net_output[0]).all()
    assert lprobs.dtype == torch.float32  # fairseq's log-softmax runs in fp32
    real = tgt.ne(d.pad())
    tol = 0.05 if dtype == torch.float16 else 0.25
    assert (lprobs - ref)[real].abs().max() < tol
    loss, nll = annotated_label_smoothing_loss(lprobs.view(-1, len(d)), tgt.view(-1), 0.1, d.pad())
    assert torch.isfinite(loss) and torch.isfinite(nll)


@pytest.mark.parametrize("dtype", CPU_HALF_DTYPES)
def test_half_precision_incremental_decoding_matches_its_full_pass(dtype):
    d = make_dictionary(50)
    model = build_tiny_model(d).to(dtype)
    src, lengths, prev, _ = padded_batch(d, SRC_LENGTHS, TGT_LENGTHS)
    with torch.no_grad():
        encoder_out = model.encoder(src, lengths)
        full = model.decoder(prev, encoder_out=encoder_out)[0]
        state = {}
        steps = [model.decoder(prev[:, :t], encoder_out=encoder_out, incremental_state=state)[0]
                 for t in range(1, prev.size(1) + 1)]
    incremental = torch.cat(steps, 1)
    assert torch.isfinite(incremental).all()
    tol = 0.02 if dtype == torch.float16 else 0.1
    real = prev.ne(d.pad())  # logits at padding positions mean nothing (zeros in a full pass)
    assert (incremental.float() - full.float())[real].abs().max() < tol
