"""The CPU dropout: Bernoulli masks from 15-bit slices of random integers."""

import pytest
import torch

from fairseq_plugin.modules.dropout import Dropout, keep_mask, rounded_drop_probability


@pytest.mark.parametrize("p", [0.1, 0.3, 0.5])
def test_each_element_is_kept_with_probability_one_minus_p(p):
    torch.manual_seed(0)
    n = 1 << 20
    keep = keep_mask(torch.Size([n]), p)
    # one standard deviation is sqrt(p (1 - p) / n) < 5e-4 overall, < 1e-3 per slice
    assert abs(keep.float().mean().item() - (1 - p)) < 3e-3
    # each of the four slices of a 63-bit word (the last one holds the word's top bits)
    for slice_ in keep.view(-1, 4).float().mean(0).tolist():
        assert abs(slice_ - (1 - p)) < 5e-3
    # neighbours are independent: P(both kept) = (1 - p)^2
    both = (keep[:-1] & keep[1:]).float().mean().item()
    assert abs(both - (1 - p) ** 2) < 5e-3


def test_the_drop_probability_is_p_rounded_to_a_multiple_of_2_to_the_minus_15():
    assert rounded_drop_probability(0.1) == 3277 / 32768
    assert abs(rounded_drop_probability(0.1) - 0.1) < 1e-5
    assert rounded_drop_probability(0.5) == 0.5
    # the mask realises the rounded p: 0.6 * 2^-15 rounds up to 2^-15 (it would truncate to 0)
    torch.manual_seed(0)
    dropped = (~keep_mask(torch.Size([1 << 20]), 0.6 / 32768)).sum().item()
    assert 10 <= dropped <= 60  # 32 expected


def test_survivors_are_scaled_by_the_rounded_p_and_the_gradient_follows_the_same_mask():
    torch.manual_seed(1)
    x = torch.randn(300, 64, requires_grad=True)
    dropout = Dropout(0.1).train()
    y = dropout(x)
    kept = y != 0
    assert 0.87 < kept.float().mean().item() < 0.93
    # 1 / (1 - 0.100006), not 1 / (1 - 0.1): they differ by 7e-6, relatively
    scale = 1 / (1 - rounded_drop_probability(0.1))
    assert torch.allclose(y[kept], x[kept] * scale, rtol=1e-6, atol=0)
    g = torch.randn_like(y)
    y.backward(g)
    assert torch.allclose(x.grad, g * kept * scale, rtol=1e-6, atol=0)


@pytest.mark.parametrize("p, cpu_mask, accepted", [
    (0.0, True, True), (1 - 2 ** -15, True, True), (1 - 2 ** -17, True, False),
    (1.0, True, False), (-0.1, True, False),
    (1 - 2 ** -17, False, True), (1.0, False, False), (-0.1, False, False)])
def test_a_dropout_built_directly_takes_only_the_probabilities_its_mask_can_draw(
        p, cpu_mask, accepted):
    """The model's flags are checked before (config.py); a Dropout built by hand checks its own:
    the CPU mask's p, rounded to a multiple of 2^-15, stays below 1; torch's takes any p below
    1."""
    from fairseq_plugin.errors import PluginError

    if accepted:
        assert Dropout(p, cpu_mask=cpu_mask).p == p
    else:
        with pytest.raises(PluginError, match=rf"dropout probability {p} is not in \[0, 1"):
            Dropout(p, cpu_mask=cpu_mask)


def test_the_mean_is_unchanged_in_expectation():
    torch.manual_seed(2)
    x = torch.ones(1 << 20)
    assert abs(Dropout(0.3).train()(x).mean().item() - 1.0) < 5e-3


def test_same_seed_same_mask_and_identity_in_eval_or_at_p_zero():
    x = torch.randn(50, 8)
    torch.manual_seed(3)
    a = Dropout(0.5).train()(x)
    torch.manual_seed(3)
    b = Dropout(0.5).train()(x)
    assert torch.equal(a, b) and not torch.equal(a, x)
    assert Dropout(0.5).eval()(x) is x
    assert Dropout(0.0).train()(x) is x


def test_training_the_model_on_the_cpu_draws_the_cheaper_mask_and_fuses_attention_dropout(
        monkeypatch):
    """Every dropout of the model outside attention takes the mask above once per forward pass;
    each attention hands its dropout to the fused kernel (the CPU half of test_cuda's check)."""
    import torch.nn.functional as F

    from conftest import build_tiny_model, make_dictionary, random_tokens
    from fairseq_plugin.modules import dropout

    calls = {"cpu mask": 0, "fused with dropout": 0}
    cpu_mask, fused = dropout._CpuDropout.apply, F.scaled_dot_product_attention

    def counted_mask(*args):
        calls["cpu mask"] += 1
        return cpu_mask(*args)

    def counted_fused(*args, dropout_p=0.0, **kwargs):
        calls["fused with dropout"] += dropout_p > 0
        return fused(*args, dropout_p=dropout_p, **kwargs)

    monkeypatch.setattr(dropout._CpuDropout, "apply", counted_mask)
    monkeypatch.setattr(F, "scaled_dot_product_attention", counted_fused)
    d = make_dictionary()
    model = build_tiny_model(d, dropout=0.3, attention_dropout=0.1).train()
    src, tgt = random_tokens(d, 4, 7), random_tokens(d, 4, 6)
    model(src, torch.full((4,), 7), tgt)[0].float().pow(2).mean().backward()
    dropouts = sum(isinstance(m, Dropout) and m.p > 0 and m.cpu_mask for m in model.modules())
    assert dropouts == 2 + 2 * 2 + 2 * 3  # embeddings, encoder and decoder sub-layers
    assert calls == {"cpu mask": dropouts, "fused with dropout": 2 + 2 * 2}


def prepared_for_inference(retain_dropout, modules=None):
    """A model as fairseq-generate prepares it (``prepare_for_inference_``), with
    --retain-dropout and --retain-dropout-modules as given."""
    from omegaconf import OmegaConf

    from conftest import build_tiny_model, make_dictionary

    model = build_tiny_model(make_dictionary(), dropout=0.3, attention_dropout=0.2,
                             activation_dropout=0.1)
    model.prepare_for_inference_(OmegaConf.create({"generation": {
        "beam": 5, "print_alignment": False, "retain_dropout": retain_dropout,
        "retain_dropout_modules": modules}}))
    return model


def retained(model):
    return {m.module_name for m in model.modules() if isinstance(m, Dropout) and m.retained}


def two_inference_passes(model, monkeypatch):
    """The decoder's output twice for the same batch, and how often attention's fused kernel
    was handed a dropout probability, torch's dropout ran (the attention that writes out its
    weights: the decoder's last source attention, whose weights it returns outside training) and
    the CPU mask was drawn."""
    import torch.nn.functional as F

    from conftest import random_tokens
    from fairseq_plugin.modules import dropout

    fused, torch_dropout, cpu_mask = (F.scaled_dot_product_attention, F.dropout,
                                      dropout._CpuDropout.apply)
    calls = {"fused with dropout": 0, "torch dropout": 0, "cpu mask": 0}

    def counted_fused(*args, dropout_p=0.0, **kwargs):
        calls["fused with dropout"] += dropout_p > 0
        return fused(*args, dropout_p=dropout_p, **kwargs)

    def counted_dropout(*args, **kwargs):
        calls["torch dropout"] += 1
        return torch_dropout(*args, **kwargs)

    def counted_mask(*args):
        calls["cpu mask"] += 1
        return cpu_mask(*args)

    monkeypatch.setattr(F, "scaled_dot_product_attention", counted_fused)
    monkeypatch.setattr(F, "dropout", counted_dropout)
    monkeypatch.setattr(dropout._CpuDropout, "apply", counted_mask)
    d = model.decoder.dictionary
    src, tgt = random_tokens(d, 4, 7), random_tokens(d, 4, 6)
    with torch.no_grad():
        outs = [model(src, torch.full((4,), 7), tgt)[0] for _ in range(2)]
    return outs, calls


def test_retain_dropout_keeps_every_dropout_on_in_inference(monkeypatch):
    """fairseq-generate --retain-dropout (Monte Carlo dropout): the model is in evaluation mode,
    yet every dropout, attention's in the fused kernel too, still drops."""
    model = prepared_for_inference(retain_dropout=True)
    assert not model.training
    assert retained(model) == {"EmbeddingLayer", "SublayerConnection", "PositionwiseFeedForward",
                               "MultiHeadedAttention"}
    (first, second), calls = two_inference_passes(model, monkeypatch)
    assert not torch.allclose(first, second)
    # two passes: 2 embeddings + 2 x 2 encoder and 2 x 3 decoder sub-layers + 2 x 2 + 2 feed-forward
    # networks draw the CPU mask; 2 encoder and 2 x 2 decoder attentions drop attention weights,
    # all in the fused kernel but the decoder's last source attention (written out)
    assert calls == {"cpu mask": 2 * (2 + 2 * 2 + 2 * 3 + 4), "fused with dropout": 2 * 5,
                     "torch dropout": 2 * 1}


# --retain-dropout-modules from the command line is one string (fairseq does not parse it)
@pytest.mark.parametrize("modules, owner, calls", [
    (["MultiHeadedAttention"], "MultiHeadedAttention",
     {"cpu mask": 0, "fused with dropout": 10, "torch dropout": 2}),
    ("MultiHeadedAttention", "MultiHeadedAttention",
     {"cpu mask": 0, "fused with dropout": 10, "torch dropout": 2}),
    ('["SublayerConnection"]', "SublayerConnection",
     {"cpu mask": 20, "fused with dropout": 0, "torch dropout": 0}),
], ids=["list", "string", "list as a string"])
def test_retain_dropout_modules_keeps_only_the_named_owners_dropout_on(modules, owner, calls,
                                                                      monkeypatch):
    model = prepared_for_inference(retain_dropout=True, modules=modules)
    assert retained(model) == {owner}
    (first, second), counted = two_inference_passes(model, monkeypatch)
    assert not torch.allclose(first, second) and counted == calls


def test_without_retain_dropout_inference_drops_nothing(monkeypatch):
    model = prepared_for_inference(retain_dropout=False)
    assert retained(model) == set()
    (first, second), calls = two_inference_passes(model, monkeypatch)
    assert torch.equal(first, second) and calls == {"cpu mask": 0, "fused with dropout": 0,
                                                    "torch dropout": 0}
