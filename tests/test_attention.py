import math

import pytest
import torch

from fairseq_plugin import reference
from fairseq_plugin.reference_weights import plain_attention
from conftest import CPU_HALF_DTYPES
from fairseq_plugin.torch_release import TORCH_RELEASE
from fairseq_plugin.modules.attention import (
    EXPLICIT,
    FUSED,
    NO_CUDNN,
    TORCH_CHOICE,
    MultiHeadedAttention,
    causal_mask,
    choose_kernel,
    explicit_attention,
)


def seed_formula(x, memory, attn, mask=None):
    """The notebook's MultiHeadedAttention with attn's weights, applied."""
    plain = plain_attention(attn)
    source = x if attn.self_attention else memory
    return plain(x, source, source, mask)


def pad_mask(pad):
    """(B, S) True at padding -> the attention mask (B, 1, 1, S), True where keys may be seen."""
    return ~pad[:, None, None, :]


@pytest.mark.parametrize("self_attention, d_memory", [(True, None), (False, None), (False, 48)])
def test_attention_equals_the_seed_formula(self_attention, d_memory):
    attn = MultiHeadedAttention(4, 32, self_attention=self_attention, d_memory=d_memory).eval()
    x, memory = torch.randn(3, 5, 32), torch.randn(3, 7, d_memory or 32)
    out, _ = attn(x, None if self_attention else memory)
    expected, _ = seed_formula(x, memory, attn)
    assert torch.allclose(out, expected, atol=1e-5)


def test_attention_weights_equal_the_seed_formula_and_sum_to_one():
    attn = MultiHeadedAttention(4, 32, self_attention=False).eval()
    x, memory = torch.randn(2, 3, 32), torch.randn(2, 6, 32)
    pad = torch.tensor([[False] * 6, [False] * 4 + [True] * 2])
    out, weights = attn(x, memory, mask=pad_mask(pad), need_weights=True)
    expected, p = seed_formula(x, memory, attn, mask=(~pad)[:, None, :])
    assert torch.allclose(out, expected, atol=1e-5)
    assert torch.allclose(weights, p, atol=1e-6)
    assert torch.allclose(weights.sum(-1), torch.ones(2, 4, 3))
    assert weights[1, :, :, 4:].abs().max() == 0


def test_padding_mask_hides_padded_keys():
    """As in the seed's src_mask: what stands at padded positions cannot change the output."""
    attn = MultiHeadedAttention(4, 32, self_attention=False).eval()
    x, memory = torch.randn(2, 3, 32), torch.randn(2, 6, 32)
    pad = torch.zeros(2, 6, dtype=torch.bool)
    pad[1, 3:] = True
    out1, _ = attn(x, memory, mask=pad_mask(pad))
    memory2 = memory.clone()
    memory2[1, 3:] = 100 * torch.randn(3, 32)
    out2, _ = attn(x, memory2, mask=pad_mask(pad))
    assert torch.allclose(out1, out2, atol=1e-6)
    memory2[0, 3:] += 1.0  # an unmasked change does change the output
    out3, _ = attn(x, memory2, mask=pad_mask(pad))
    assert not torch.allclose(out1[0], out3[0], atol=1e-3)


def test_causal_mask_is_the_seeds_subsequent_mask():
    assert torch.equal(causal_mask(5, 5, "cpu"), reference.subsequent_mask(5)[0])
    # with 3 cached positions, 2 new queries see everything up to themselves
    assert causal_mask(2, 5, "cpu").tolist() == [[True] * 4 + [False], [True] * 5]


def test_causal_self_attention_ignores_future_positions():
    attn = MultiHeadedAttention(4, 32, self_attention=True, causal=True).eval()
    x = torch.randn(2, 6, 32)
    out1, _ = attn(x)
    x2 = x.clone()
    x2[:, 4:] = torch.randn(2, 2, 32)
    out2, _ = attn(x2)
    assert torch.allclose(out1[:, :4], out2[:, :4], atol=1e-6)
    assert not torch.allclose(out1[:, 4:], out2[:, 4:], atol=1e-3)
    expected, _ = seed_formula(x, x, attn, mask=reference.subsequent_mask(6))
    assert torch.allclose(out1, expected, atol=1e-5)


@pytest.mark.parametrize("need_weights", [False, True])
def test_fully_padded_row_gives_zeros_not_nan(need_weights):
    attn = MultiHeadedAttention(4, 32, self_attention=False).eval()
    x, memory = torch.randn(2, 3, 32), torch.randn(2, 4, 32)
    pad = torch.tensor([[False] * 4, [True] * 4])
    out, weights = attn(x, memory, mask=pad_mask(pad), need_weights=need_weights)
    assert not torch.isnan(out).any()
    # nothing to attend to: the attention result is zero, so only W^O's bias remains
    assert torch.allclose(out[1], attn.out_proj.bias.expand(3, 32), atol=1e-6)
    if need_weights:
        assert weights[1].abs().max() == 0


@pytest.mark.parametrize("kernel_returns", ["nan", "mean of the values"])
def test_fully_padded_row_zeroed_also_where_the_fused_kernel_does_not(monkeypatch,
                                                                      kernel_returns):
    """torch < 2.5's fused kernel returns NaN for a query that may see no key, and a GPU backend
    may return the mean of the values (a finite fill for masked keys); the zeroing used where
    zeros are not certain gives the same result as the written-out formula."""
    import torch.nn.functional as F

    from fairseq_plugin.modules import attention as attention_module

    sdpa = F.scaled_dot_product_attention

    calls = []

    def other_sdpa(q, k, v, attn_mask=None, **kwargs):  # NaN or mean(V) where a row sees nothing
        calls.append(attn_mask)
        out = sdpa(q, k, v, attn_mask=attn_mask, **kwargs)
        empty = ~attn_mask.any(-1, keepdim=True)
        if kernel_returns == "nan":
            return out.masked_fill(empty, float("nan"))
        return torch.where(empty, v.mean(-2, keepdim=True), out)

    attn = MultiHeadedAttention(4, 32, self_attention=False).eval()
    x, memory = torch.randn(2, 3, 32), torch.randn(2, 4, 32)
    pad = torch.tensor([[False, False, True, True], [True] * 4])
    attn.force_kernel(EXPLICIT)
    expected, _ = attn(x, memory, mask=pad_mask(pad))
    attn.force_kernel(FUSED)
    monkeypatch.setattr(attention_module.F, "scaled_dot_product_attention", other_sdpa)
    monkeypatch.setattr(attention_module, "fused_kernel_zeroes_empty_rows", lambda q: False)
    out, _ = attn(x, memory, mask=pad_mask(pad))
    assert len(calls) == 1  # the fused kernel ran
    assert not torch.isnan(out).any()
    assert torch.allclose(out, expected, atol=1e-6)


def test_the_fused_kernel_is_trusted_with_fully_padded_rows_only_on_the_cpu_of_torch_2_5_on():
    from fairseq_plugin.modules.attention import fused_kernel_zeroes_empty_rows
    from fairseq_plugin.torch_release import TORCH_RELEASE

    assert fused_kernel_zeroes_empty_rows(torch.zeros(1)) == (TORCH_RELEASE >= (2, 5))
    assert not fused_kernel_zeroes_empty_rows(torch.zeros(1, device="meta"))  # any other device


@pytest.mark.parametrize("dtype", CPU_HALF_DTYPES)
@pytest.mark.parametrize("need_weights", [False, True])
def test_half_precision_gives_no_inf_and_stays_close_to_fp32(dtype, need_weights):
    attn = MultiHeadedAttention(4, 64, self_attention=False).eval()
    x, memory = 3 * torch.randn(2, 5, 64), 3 * torch.randn(2, 7, 64)
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[0, 4:] = True
    pad[1, :] = True  # a fully padded row too
    ref, _ = attn(x, memory, mask=pad_mask(pad), need_weights=need_weights)
    half = attn.to(dtype)
    out, weights = half(x.to(dtype), memory.to(dtype), mask=pad_mask(pad),
                        need_weights=need_weights)
    assert torch.isfinite(out).all()
    assert (weights is not None) == need_weights
    if need_weights:
        assert torch.isfinite(weights).all()
    tol = 0.05 if dtype == torch.float16 else 0.15
    assert (out.float() - ref).abs().max() < tol


@pytest.mark.parametrize("dtype", CPU_HALF_DTYPES[:1])  # fp16 (bf16 has fp32's range)
def test_written_out_attention_scores_half_precision_inputs_in_fp32(dtype):
    """Scores beyond fp16's largest number (65504) still give the fp32 result: the scores and the
    softmax are computed in fp32, and the weights come back in fp32."""
    g = torch.Generator().manual_seed(0)
    q = (300 * torch.rand(2, 4, 3, 16, generator=g)).to(dtype)  # q.k / 4 up to 3.6e5
    k = (300 * torch.rand(2, 4, 5, 16, generator=g)).to(dtype)
    v = torch.randn(2, 4, 5, 16, generator=g).to(dtype)
    mask = torch.ones(2, 1, 1, 5, dtype=torch.bool)
    mask[0, ..., 3:] = False
    out, weights = explicit_attention(q, k, v, mask)
    expected_out, expected_weights = reference.attention(q.double(), k.double(), v.double(), mask)
    assert weights.dtype == torch.float32 and out.dtype == dtype
    assert (q.float() @ k.float().transpose(-2, -1)).max() / 4 > 65504  # it would overflow fp16
    assert torch.allclose(weights.double(), expected_weights, atol=1e-4)
    assert torch.allclose(out.double(), expected_out, atol=0.05)


def test_heads_must_divide_d_model():
    with pytest.raises(ValueError, match="d_model 32 is not a multiple of h = 3"):
        MultiHeadedAttention(3, 32)


def test_kernel_choice_is_fused_unless_the_weights_are_needed_or_a_kernel_is_forced():
    assert choose_kernel(need_weights=False) == FUSED
    assert choose_kernel(need_weights=True) == EXPLICIT
    assert choose_kernel(False, forced=EXPLICIT) == EXPLICIT
    assert choose_kernel(True, forced=FUSED) == EXPLICIT  # weights need the formula


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_fused_and_written_out_kernels_agree_with_masks(causal, padded, monkeypatch):
    import torch.nn.functional as F
    fused_calls, sdpa = [], F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda *args, **kwargs: (fused_calls.append(1), sdpa(*args, **kwargs))[1])
    attn = MultiHeadedAttention(4, 32, self_attention=True, causal=causal).eval()
    x = torch.randn(3, 6, 32)
    pad = torch.zeros(3, 6, dtype=torch.bool)
    pad[1, 4:] = True
    pad[2, :2] = True  # left padding
    mask = pad_mask(pad) if padded else None
    results = {}
    for kernel in (FUSED, EXPLICIT):
        attn.force_kernel(kernel)
        fused_calls.clear()
        results[kernel] = attn(x, mask=mask)[0]
        assert len(fused_calls) == (kernel == FUSED)  # each kernel ran, and only it
    expected, _ = seed_formula(x, x, attn, mask=None if not (causal or padded) else (
        (reference.subsequent_mask(6) if causal else True) & ((~pad)[:, None, :] if padded else True)))
    real = ~pad if padded else torch.ones(3, 6, dtype=torch.bool)
    if causal and padded:
        real[2, :2] = False  # a left-padded query sees nothing: zeros here, not the notebook's
    for out in results.values():
        assert torch.allclose(out[real], expected[real], atol=1e-5)
    assert torch.allclose(results[FUSED], results[EXPLICIT], atol=1e-5)


def test_separate_widths_initialise_each_projection_as_its_own_glorot_matrix():
    """Encoder width 128, decoder width 96: W^K and W^V of the source attention are 96 x 128."""
    torch.manual_seed(0)
    attn = MultiHeadedAttention(4, 96, self_attention=False, d_memory=128)
    w_k, w_v = attn.kv_proj.weight.split(96, dim=0)
    bound = math.sqrt(6.0 / (96 + 128))  # Glorot uniform for a 96 x 128 matrix
    for w in (w_k, w_v):
        assert w.shape == (96, 128)
        assert w.abs().max() <= bound and w.abs().max() > 0.95 * bound
    q_bound = math.sqrt(6.0 / (96 + 96))
    assert q_bound * 0.95 < attn.q_proj.weight.abs().max() <= q_bound


@pytest.mark.parametrize("linear_init", ["glorot", "fairseq"])
def test_a_model_with_encoder_width_128_and_decoder_width_96_initialises_every_matrix_on_its_own(
        linear_init):
    """Each of W^Q, W^K, W^V, W^O Glorot uniform on its own shape; with --linear-init fairseq,
    W^Q, W^K, W^V with gain 1/sqrt(2) where queries and memory have one width (self-attention)
    and gain 1 where they differ (decoder-source attention, 96 and 128), as fairseq's."""
    from conftest import build_tiny_model

    model = build_tiny_model(encoder_embed_dim=128, decoder_embed_dim=96,
                             encoder_attention_heads=4, decoder_attention_heads=4,
                             linear_init=linear_init)
    gain = 2 ** -0.5 if linear_init == "fairseq" else 1.0  # W^Q, W^K, W^V of self-attention

    def glorot(w, rows, cols, gain=1.0):  # nn.Linear's bound, 1 / sqrt(cols), is below 0.95 of it
        bound = gain * math.sqrt(6.0 / (rows + cols))
        return w.shape == (rows, cols) and 0.95 * bound < w.abs().max() <= bound

    for layer in model.decoder.layers:
        w_k, w_v = layer.src_attn.kv_proj.weight.split(96, dim=0)
        assert glorot(layer.src_attn.q_proj.weight, 96, 96)
        assert glorot(w_k, 96, 128) and glorot(w_v, 96, 128)
        assert all(glorot(w, 96, 96, gain) for w in layer.self_attn.qkv_proj.weight.split(96, dim=0))
        assert glorot(layer.self_attn.out_proj.weight, 96, 96)
        assert glorot(layer.src_attn.out_proj.weight, 96, 96)
    for layer in model.encoder.layers:
        assert all(glorot(w, 128, 128, gain)
                   for w in layer.self_attn.qkv_proj.weight.split(128, dim=0))
        assert glorot(layer.self_attn.out_proj.weight, 128, 128)


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_no_cudnn_switches_cudnn_attention_off_around_the_layers_once_per_forward(device,
                                                                                  monkeypatch):
    """--fused-attention-backends no-cudnn: torch's cuDNN backend is off while every fused
    attention call of the encoder and the decoder runs (read inside each call), switched once per
    forward of each stack, not per call; the user's setting is back afterwards, and torch's
    choice leaves it alone; the model's output is the same. "cuda": the model runs on the CPU,
    but its stacks switch as they would on a CUDA device; "cpu": as it is, nothing is switched
    (the CPU has no cuDNN attention)."""
    import torch.nn.functional as F

    from conftest import build_tiny_model, make_dictionary, random_tokens
    from fairseq_plugin.models import decoder, encoder
    from fairseq_plugin.modules.attention import fused_backends

    if not hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
        pytest.skip("this torch has no cuDNN attention backend to switch off")
    if device == "cuda":
        for stack in (encoder, decoder):
            monkeypatch.setattr(stack, "fused_backends",
                                lambda backends, _: fused_backends(backends, torch.device("cuda")))
    seen, sdpa = [], F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *args, **kwargs: (
        seen.append(torch.backends.cuda.cudnn_sdp_enabled()), sdpa(*args, **kwargs))[1])
    switches, switch = [], torch.backends.cuda.enable_cudnn_sdp
    monkeypatch.setattr(torch.backends.cuda, "enable_cudnn_sdp",
                        lambda on: (switches.append(on), switch(on))[1])
    d = make_dictionary(40)
    src, prev = random_tokens(d, 3, 7), random_tokens(d, 3, 5)
    src[1, :2] = d.pad()  # a source mask, in every attention over the source
    results, users = {}, torch.backends.cuda.cudnn_sdp_enabled()
    try:
        for user_setting in (True, False):
            switch(user_setting)
            for backends in (TORCH_CHOICE, NO_CUDNN):
                torch.manual_seed(0)
                model = build_tiny_model(d, fused_attention_backends=backends).eval()
                model.decoder.need_attn = False  # the fused kernel in every attention
                layers = len(model.encoder.layers) + 2 * len(model.decoder.layers)
                seen.clear()
                switches.clear()
                results[backends] = model(src, torch.full((3,), 7), prev)[0]
                switched = backends == NO_CUDNN and device == "cuda"
                assert seen == [user_setting and not switched] * layers
                # off and back, once around each stack's layers (none under torch's choice)
                assert switches == ([False, user_setting] * 2 if switched else [])
                assert torch.backends.cuda.cudnn_sdp_enabled() == user_setting  # restored
    finally:
        switch(users)
    assert torch.equal(results[TORCH_CHOICE], results[NO_CUDNN])


def test_an_unknown_backends_choice_is_refused():
    from fairseq_plugin.modules.attention import check_backends

    with pytest.raises(ValueError, match="'torch' or 'no-cudnn'"):
        check_backends("cudnn")
    assert check_backends(NO_CUDNN) == NO_CUDNN


@pytest.mark.skipif(TORCH_RELEASE < (2, 13), reason="torch 2.1's unbind backward fills zeros, then "
                    "copies each head in (n + 1 launches, measured); torch 2.13's stacks them (1)")
@pytest.mark.parametrize("n", [3, 2, 1])
def test_splitting_heads_gathers_the_projections_gradient_with_one_copy(n):
    """split_heads' backward stacks the n heads' gradients straight into the projection's layout
    (B, L, n * d_model): one operation launched, not a stack and then a copy of its result."""
    from fairseq_plugin.testing.operations import OperationCounter

    attn = MultiHeadedAttention(4, 32)
    x = torch.randn(2, 5, n * 32, requires_grad=True)
    heads = attn.split_heads(x, n)
    assert [t.shape for t in heads] == [(2, 4, 5, 8)] * n
    assert torch.equal(torch.stack(heads, 2).transpose(1, 3).reshape(2, 5, -1), x)
    grads = [torch.randn_like(t) for t in heads]
    with OperationCounter() as counter:
        (grad,) = torch.autograd.grad(heads, x, grads)
    assert counter.launches == 1
    assert torch.equal(grad, torch.stack(grads, 2).transpose(1, 3).reshape(2, 5, -1))
