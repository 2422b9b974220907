import math

import pytest
import torch

from fairseq_plugin.errors import PluginError
from fairseq_plugin.modules.attention import MultiHeadedAttention, causal_mask


def seed_formula(x, memory, attn, mask=None):
    """The seed's MultiHeadedAttention written out with separate W^Q, W^K, W^V, W^O:
    heads split from d_model, softmax(Q K^T / sqrt(d_k)) with masked scores, concat, W^O."""
    h, d_k = attn.h, attn.d_k
    d = h * d_k
    if attn.self_attention:
        W, b = attn.qkv_proj.weight, attn.qkv_proj.bias
        Wq, Wk, Wv = W[:d], W[d:2 * d], W[2 * d:]
        bq, bk, bv = b[:d], b[d:2 * d], b[2 * d:]
        memory = x
    else:
        Wq, bq = attn.q_proj.weight, attn.q_proj.bias
        Wk, Wv = attn.kv_proj.weight[:d], attn.kv_proj.weight[d:]
        bk, bv = attn.kv_proj.bias[:d], attn.kv_proj.bias[d:]
    B, T, _ = x.shape
    S = memory.size(1)
    q = (x @ Wq.T + bq).view(B, T, h, d_k).transpose(1, 2)
    k = (memory @ Wk.T + bk).view(B, S, h, d_k).transpose(1, 2)
    v = (memory @ Wv.T + bv).view(B, S, h, d_k).transpose(1, 2)
    scores = q @ k.transpose(-2, -1) / math.sqrt(d_k)
    if mask is not None:
        scores = scores.masked_fill(mask == 0, -1e9)
    p = scores.softmax(-1)
    out = (p @ v).transpose(1, 2).reshape(B, T, d)
    return out @ attn.out_proj.weight.T + attn.out_proj.bias, p


@pytest.mark.parametrize("self_attention", [True, False])
def test_attention_equals_the_seed_formula(self_attention):
    attn = MultiHeadedAttention(4, 32, self_attention=self_attention).eval()
    x, memory = torch.randn(3, 5, 32), torch.randn(3, 7, 32)
    out, _ = attn(x, None if self_attention else memory)
    expected, _ = seed_formula(x, memory, attn)
    assert torch.allclose(out, expected, atol=1e-5)


def test_attention_weights_equal_the_seed_formula_and_sum_to_one():
    attn = MultiHeadedAttention(4, 32, self_attention=False).eval()
    x, memory = torch.randn(2, 3, 32), torch.randn(2, 6, 32)
    pad = torch.tensor([[False] * 6, [False] * 4 + [True] * 2])
    out, weights = attn(x, memory, key_padding_mask=pad, need_weights=True)
    expected, p = seed_formula(x, memory, attn, mask=(~pad)[:, None, None, :])
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
    out1, _ = attn(x, memory, key_padding_mask=pad)
    memory2 = memory.clone()
    memory2[1, 3:] = 100 * torch.randn(3, 32)
    out2, _ = attn(x, memory2, key_padding_mask=pad)
    assert torch.allclose(out1, out2, atol=1e-6)
    memory2[0, 3:] += 1.0  # an unmasked change does change the output
    out3, _ = attn(x, memory2, key_padding_mask=pad)
    assert not torch.allclose(out1[0], out3[0], atol=1e-3)


def test_causal_mask_is_the_seeds_subsequent_mask():
    # the seed: subsequent_mask(size) = triu(ones, diagonal=1) == 0
    seed = torch.triu(torch.ones(5, 5), diagonal=1) == 0
    assert torch.equal(causal_mask(5, 5, "cpu"), seed)
    # with 3 cached positions, 2 new queries see everything up to themselves
    assert causal_mask(2, 5, "cpu").tolist() == [[True] * 4 + [False], [True] * 5]


def test_causal_self_attention_ignores_future_positions():
    attn = MultiHeadedAttention(4, 32, self_attention=True).eval()
    x = torch.randn(2, 6, 32)
    out1, _ = attn(x, causal=True)
    x2 = x.clone()
    x2[:, 4:] = torch.randn(2, 2, 32)
    out2, _ = attn(x2, causal=True)
    assert torch.allclose(out1[:, :4], out2[:, :4], atol=1e-6)
    assert not torch.allclose(out1[:, 4:], out2[:, 4:], atol=1e-3)
    expected, _ = seed_formula(x, x, attn, mask=causal_mask(6, 6, "cpu"))
    assert torch.allclose(out1, expected, atol=1e-5)


@pytest.mark.parametrize("need_weights", [False, True])
def test_fully_padded_row_gives_zeros_not_nan(need_weights):
    attn = MultiHeadedAttention(4, 32, self_attention=False).eval()
    x, memory = torch.randn(2, 3, 32), torch.randn(2, 4, 32)
    pad = torch.tensor([[False] * 4, [True] * 4])
    out, weights = attn(x, memory, key_padding_mask=pad, need_weights=need_weights)
    assert not torch.isnan(out).any()
    # nothing to attend to: the attention result is zero, so only W^O's bias remains
    assert torch.allclose(out[1], attn.out_proj.bias.expand(3, 32), atol=1e-6)
    if need_weights:
        assert weights[1].abs().max() == 0


def test_fully_padded_row_zeroed_also_on_torch_without_it(monkeypatch):
    """The explicit zeroing used for torch < 2.5 gives the same result."""
    from fairseq_plugin.modules import attention as attention_module

    attn = MultiHeadedAttention(4, 32, self_attention=False).eval()
    x, memory = torch.randn(2, 3, 32), torch.randn(2, 4, 32)
    pad = torch.tensor([[False, False, True, True], [True] * 4])
    expected, _ = attn(x, memory, key_padding_mask=pad)
    monkeypatch.setattr(attention_module, "_SDPA_ZEROES_EMPTY_ROWS", False)
    out, _ = attn(x, memory, key_padding_mask=pad)
    assert torch.allclose(out, expected, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("need_weights", [False, True])
def test_half_precision_gives_no_inf_and_stays_close_to_fp32(dtype, need_weights):
    attn = MultiHeadedAttention(4, 64, self_attention=False).eval()
    x, memory = 3 * torch.randn(2, 5, 64), 3 * torch.randn(2, 7, 64)
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[0, 4:] = True
    pad[1, :] = True  # a fully padded row too
    ref, _ = attn(x, memory, key_padding_mask=pad, need_weights=need_weights)
    half = attn.to(dtype)
    out, weights = half(x.to(dtype), memory.to(dtype), key_padding_mask=pad,
                        need_weights=need_weights)
    assert torch.isfinite(out).all()
    if weights is not None:
        assert torch.isfinite(weights).all()
    tol = 0.05 if dtype == torch.float16 else 0.15
    assert (out.float() - ref).abs().max() < tol


def test_heads_must_divide_d_model():
    with pytest.raises(PluginError, match="not divisible"):
        MultiHeadedAttention(3, 32)
