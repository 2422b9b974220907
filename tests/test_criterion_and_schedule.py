from argparse import Namespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from fairseq.optim import FairseqOptimizer

from conftest import build_tiny_model, make_dictionary, random_tokens
from fairseq_plugin.criterions.annotated_label_smoothing import (
    AnnotatedLabelSmoothingCriterion,
    SmoothedLossFromLogits,
    annotated_label_smoothing_loss,
    log_softmax_of_logits,
)
from fairseq_plugin.errors import PluginError
from fairseq_plugin.reference import LabelSmoothing
from fairseq_plugin.lr_scheduler.noam import NoamSchedule


@pytest.mark.parametrize("eps", [0.1, 0.3])
def test_criterion_equals_the_seed_formula(eps):
    V, pad = 50, 1
    lprobs = torch.randn(64, V, dtype=torch.float64).log_softmax(-1)
    target = torch.randint(4, V, (64,))
    target[::7] = pad
    loss, nll = annotated_label_smoothing_loss(lprobs, target, eps, pad)
    expected = LabelSmoothing(V, pad, eps)(lprobs, target)
    assert torch.allclose(loss.double(), expected, rtol=1e-5)
    not_pad = target.ne(pad)
    assert torch.allclose(nll.double(), -lprobs[not_pad].gather(1, target[not_pad, None]).sum())


def test_criterion_at_eps_zero_equals_nll():
    V, pad = 30, 1
    lprobs = torch.randn(40, V).log_softmax(-1)
    target = torch.randint(4, V, (40,))
    target[:5] = pad
    loss, nll = annotated_label_smoothing_loss(lprobs, target, 0.0, pad)
    expected = F.nll_loss(lprobs, target, ignore_index=pad, reduction="sum")
    assert torch.allclose(loss, expected, rtol=1e-5)
    assert torch.allclose(nll, expected, rtol=1e-5)


def test_criterion_per_token_losses_sum_to_the_loss_and_padding_counts_nothing():
    """reduce=False gives each token's loss (N,); a padding row adds 0 even where its
    log-probabilities are not finite (they are the model's output at padding)."""
    V, pad = 30, 1
    lprobs = torch.randn(12, V).log_softmax(-1)
    target = torch.randint(4, V, (12,))
    target[[2, 7]] = pad
    loss, nll = annotated_label_smoothing_loss(lprobs, target, 0.1, pad)
    lprobs[2] = float("nan")
    lprobs[7, 5] = float("-inf")
    per_token, per_token_nll = annotated_label_smoothing_loss(lprobs, target, 0.1, pad,
                                                              reduce=False)
    assert per_token.shape == per_token_nll.shape == (12,)
    assert per_token[[2, 7]].tolist() == per_token_nll[[2, 7]].tolist() == [0.0, 0.0]
    assert torch.allclose(per_token.sum(), loss) and torch.allclose(per_token_nll.sum(), nll)


def test_criterion_sums_half_precision_log_probabilities_in_fp32():
    """Under --fp16 the sum over a 32k vocabulary of log-probabilities overflows fp16 (65504):
    the loss is summed in fp32, equal to the fp32 loss of the same (rounded) inputs."""
    V, pad = 32000, 1
    lprobs = torch.randn(8, V).mul(3).log_softmax(-1).half()
    target = torch.randint(4, V, (8,))
    loss, nll = annotated_label_smoothing_loss(lprobs, target, 0.1, pad)
    expected, expected_nll = annotated_label_smoothing_loss(lprobs.float(), target, 0.1, pad)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert torch.allclose(loss, expected, rtol=1e-6)
    assert torch.allclose(nll, expected_nll, rtol=1e-6)


@pytest.mark.parametrize("eps", [0.1, 0.3])
def test_criterion_in_fairseq_is_the_notebooks_label_smoothing_of_the_models_output(eps):
    """The registered criterion on a padded batch: its loss is the notebook's LabelSmoothing (KL
    summed over real tokens) of the model's log-probabilities, its nll_loss the summed NLL, and
    it logs what fairseq's trainer reads."""
    d = make_dictionary()
    model = build_tiny_model(d).eval()  # no dropout: the two forward passes agree
    task = Namespace(target_dictionary=d)
    crit = AnnotatedLabelSmoothingCriterion(task, sentence_avg=False, label_smoothing=eps)
    src = random_tokens(d, 3, 6)
    tgt = random_tokens(d, 3, 5)
    tgt[1, 3:] = d.pad()
    prev = torch.cat([torch.full((3, 1), d.eos()), tgt[:, :-1]], 1)
    ntokens = int(tgt.ne(d.pad()).sum())
    sample = {"net_input": {"src_tokens": src, "src_lengths": torch.full((3,), 6),
                            "prev_output_tokens": prev},
              "target": tgt, "ntokens": ntokens}
    loss, sample_size, log = crit(model, sample)
    lprobs = model.get_normalized_probs(model(**sample["net_input"]), log_probs=True)
    lprobs, target = lprobs.view(-1, len(d)).double(), tgt.view(-1)
    real = target.ne(d.pad())
    assert sample_size == ntokens == 13
    assert torch.allclose(loss.double(), LabelSmoothing(len(d), d.pad(), eps)(lprobs, target),
                          rtol=1e-5)
    assert torch.allclose(log["nll_loss"].double(),
                          -lprobs[real].gather(1, target[real, None]).sum(), rtol=1e-5)
    assert set(log) >= {"loss", "nll_loss", "ntokens", "nsentences", "sample_size"}
    assert (log["ntokens"], log["nsentences"], log["sample_size"]) == (13, 3, 13)
    assert float(log["loss"]) == pytest.approx(float(loss), rel=1e-6)


def test_criterion_keeps_fairseqs_report_accuracy_ignore_prefix_size_and_sentence_avg():
    """The options label_smoothed_cross_entropy users pass work the same here."""
    d = make_dictionary()
    model = build_tiny_model(d).eval()
    task = Namespace(target_dictionary=d)
    src, prev = random_tokens(d, 3, 6), random_tokens(d, 3, 5)  # targets: set below
    net_input = {"src_tokens": src, "src_lengths": torch.full((3,), 6), "prev_output_tokens": prev}
    lprobs = model.get_normalized_probs(model(**net_input), log_probs=True).double()
    # --report-accuracy: the model's own best tokens but in the first row, which it misses
    tgt = lprobs.argmax(-1)
    tgt[0] = torch.where(tgt[0] == 4, 5, 4)
    sample = {"net_input": net_input, "target": tgt, "ntokens": 15}
    _, _, log = AnnotatedLabelSmoothingCriterion(task, False, 0.1, report_accuracy=True)(
        model, sample)
    assert (log["n_correct"], log["total"]) == (10, 15)
    # --ignore-prefix-size 2: the first two target tokens are not scored
    loss, _, _ = AnnotatedLabelSmoothingCriterion(task, False, 0.1, ignore_prefix_size=2)(
        model, sample)
    expected = LabelSmoothing(len(d), d.pad(), 0.1)(lprobs[:, 2:].reshape(-1, len(d)),
                                                    tgt[:, 2:].reshape(-1))
    assert torch.allclose(loss.double(), expected, rtol=1e-5)
    # --sentence-avg: the gradient is normalised by sentences, not tokens
    _, sample_size, _ = AnnotatedLabelSmoothingCriterion(task, True, 0.1)(model, sample)
    assert sample_size == 3


def smoothed_batch(N=14, V=11, pad=1, dtype=torch.float64):
    """Logits with a padding row, a row at the padding column and gold tokens at both ends."""
    torch.manual_seed(3)
    logits = torch.randn(N, V, dtype=dtype).mul(2)
    target = torch.randint(2, V, (N,))
    target[[3, 9]] = pad
    target[0], target[1] = 0, V - 1
    return logits, target, pad


@pytest.mark.parametrize("eps", [0.1, 0.0])
@pytest.mark.parametrize("weighted_nll", [False, True])
def test_the_fused_loss_gives_the_plain_loss_and_autograds_gradient(eps, weighted_nll):
    """SmoothedLossFromLogits: the same per-token loss and nll_loss as the closed form on
    log_softmax(logits), and the gradient autograd finds through them, whatever weighs each
    token's loss and nll_loss downstream (fairseq backpropagates the loss alone: nll_loss None)."""
    logits, target, pad = smoothed_batch()
    w_loss, w_nll = torch.rand(2, len(target), dtype=logits.dtype)

    def run(loss_fn):
        x = logits.clone().requires_grad_()
        loss, nll = loss_fn(x)
        ((loss * w_loss).sum() + ((nll * w_nll).sum() if weighted_nll else 0)).backward()
        return loss.detach(), nll.detach(), x.grad

    plain = run(lambda x: annotated_label_smoothing_loss(x.log_softmax(-1), target, eps, pad,
                                                         reduce=False))
    fused = run(lambda x: SmoothedLossFromLogits.apply(x, target, eps, pad))
    for a, b in zip(plain, fused):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)
    assert fused[2][[3, 9]].abs().max() == 0  # padding rows: no gradient
    x = logits.clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda x: SmoothedLossFromLogits.apply(x, target, eps, pad), x)


def test_the_fused_loss_of_bf16_logits_is_taken_in_fp32_and_its_gradient_is_bf16():
    logits, target, pad = smoothed_batch(dtype=torch.float32)
    half = logits.bfloat16().requires_grad_()
    loss, nll = SmoothedLossFromLogits.apply(half, target, 0.1, pad)
    loss.sum().backward()
    reference = logits.bfloat16().float().requires_grad_()
    expected, _ = annotated_label_smoothing_loss(reference.log_softmax(-1), target, 0.1, pad,
                                                 reduce=False)
    expected.sum().backward()
    assert loss.dtype == torch.float32 and torch.equal(loss, expected.detach())
    assert half.grad.dtype == torch.bfloat16
    assert torch.allclose(half.grad.float(), reference.grad, rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("plain_loss", [False, True])
def test_the_criterion_takes_the_loss_from_the_logits_only_where_they_give_the_log_probabilities(
        plain_loss):
    """The fused loss for this plugin's model (also behind a DDP-like wrapper), not for a model
    whose get_normalized_probs is its own, nor under --plain-loss; both ways the same loss and
    the same gradient of every parameter."""
    d = make_dictionary()
    model = build_tiny_model(d).eval()
    sample = training_batch(d)
    assert log_softmax_of_logits(model) and log_softmax_of_logits(_Wrapped(_Wrapped(model)))

    class OwnProbabilities(type(model)):
        def get_normalized_probs(self, net_output, log_probs, sample=None):
            return super().get_normalized_probs(net_output, log_probs, sample)

    own = build_tiny_model(d)
    own.__class__ = OwnProbabilities
    assert not log_softmax_of_logits(own)
    calls = []
    original = SmoothedLossFromLogits.apply
    task = Namespace(target_dictionary=d)

    def step(crit):
        model.zero_grad()
        loss, _, log = crit(model, sample)
        loss.backward()
        return loss.detach(), log["nll_loss"], [p.grad.clone() for p in model.parameters()]

    def counted(*args):
        calls.append(1)
        return original(*args)

    SmoothedLossFromLogits.apply = counted
    try:
        fused = step(AnnotatedLabelSmoothingCriterion(task, False, 0.1, plain_loss=plain_loss))
    finally:
        SmoothedLossFromLogits.apply = original
    assert len(calls) == (0 if plain_loss else 1)
    plain = step(AnnotatedLabelSmoothingCriterion(task, False, 0.1, plain_loss=True))
    assert torch.allclose(fused[0], plain[0], rtol=1e-6)
    assert torch.allclose(fused[1], plain[1], rtol=1e-6)
    worst = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(fused[2], plain[2]))
    assert worst < 1e-5  # fp32, relative to each gradient's largest element


class _Wrapped(nn.Module):
    """What DDP and fairseq's ModuleProxyWrapper look like from a criterion: ``.module``."""

    def __init__(self, module):
        super().__init__()
        self.module = module


def training_batch(d):
    src, tgt = random_tokens(d, 3, 6), random_tokens(d, 3, 5)
    tgt[1, 3:] = d.pad()
    prev = torch.cat([torch.full((3, 1), d.eos()), tgt[:, :-1]], 1)
    return {"net_input": {"src_tokens": src, "src_lengths": torch.full((3,), 6),
                          "prev_output_tokens": prev},
            "target": tgt, "ntokens": int(tgt.ne(d.pad()).sum())}


class _Optimizer(FairseqOptimizer):
    def __init__(self):
        super().__init__(cfg=None)
        self._optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.5)


def noam_formula(step, d_model, factor, warmup):
    step = max(step, 1)
    return factor * d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)


def test_noam_sets_the_formulas_learning_rate():
    opt = _Optimizer()
    args = Namespace(warmup_updates=4000, noam_factor=2.0, noam_model_dim=None,
                     encoder_embed_dim=512)
    sched = NoamSchedule(args, opt)
    assert opt.get_lr() == pytest.approx(noam_formula(1, 512, 2.0, 4000))
    for step in (1, 10, 3999, 4000, 4001, 20000):
        lr = sched.step_update(step)
        assert lr == pytest.approx(noam_formula(step, 512, 2.0, 4000), rel=1e-12)
        assert opt.get_lr() == lr
    # warmup rises linearly, then decays as step^-0.5
    assert sched.rate(2000) == pytest.approx(sched.rate(1000) * 2)
    assert sched.rate(16000) == pytest.approx(sched.rate(4000) / 2)


def test_noam_model_dim_overrides_the_models():
    args = Namespace(warmup_updates=100, noam_factor=1.0, noam_model_dim=64, encoder_embed_dim=512)
    assert NoamSchedule(args, _Optimizer()).rate(100) == pytest.approx(64 ** -0.5 * 100 ** -0.5)


def test_noam_without_d_model_is_a_clear_error():
    args = Namespace(warmup_updates=100, noam_factor=1.0, noam_model_dim=None)
    with pytest.raises(PluginError, match="--noam-model-dim"):
        NoamSchedule(args, _Optimizer())


@pytest.mark.parametrize("model, d_model", [
    ({"_name": "annotated_transformer_big"}, 1024),  # a preset's size, not written out
    ({"_name": "annotated_transformer", "encoder_embed_dim": 256}, 256),
    (None, None)], ids=["preset", "written out", "no model"])
def test_noam_reads_d_model_from_the_hydra_training_configuration(model, d_model):
    """fairseq-hydra-train hands the schedule its ``lr_scheduler`` node of the whole training
    configuration: d_model is the model's, a preset's resolved, or the run is refused."""
    from omegaconf import OmegaConf

    root = {"lr_scheduler": {"_name": "noam", "warmup_updates": 100, "noam_factor": 1.0,
                             "noam_model_dim": None}}
    if model is not None:
        root["model"] = model
    cfg = OmegaConf.create(root).lr_scheduler
    if d_model is None:
        with pytest.raises(PluginError, match=r"pass --noam-model-dim"):
            NoamSchedule(cfg, _Optimizer())
        return
    assert NoamSchedule(cfg, _Optimizer()).model_dim == d_model


@pytest.mark.parametrize("option, value, message", [
    ("warmup_updates", 0, "--warmup-updates must be positive"),
    ("noam_factor", -1.0, "--noam-factor must be positive"),
    ("noam_factor", 0.0, "--noam-factor must be positive"),  # a rate of 0 all the run
    ("noam_model_dim", 0, "--noam-model-dim must be positive"),
    ("noam_model_dim", -512, "--noam-model-dim must be positive")])
def test_noam_refuses_a_rate_that_is_not_positive(option, value, message):
    args = Namespace(**{"warmup_updates": 100, "noam_factor": 1.0, "noam_model_dim": None,
                        "encoder_embed_dim": 512, option: value})
    with pytest.raises(PluginError, match=message):
        NoamSchedule(args, _Optimizer())


@pytest.mark.parametrize("eps", [-0.2, 1.0, 1.5])
def test_label_smoothing_outside_zero_to_one_is_a_clear_error(eps):
    task = Namespace(target_dictionary=make_dictionary())
    with pytest.raises(PluginError, match=rf"--label-smoothing {eps} is not in \[0, 1\)"):
        AnnotatedLabelSmoothingCriterion(task, sentence_avg=False, label_smoothing=eps)
    for edge in (0.0, 0.999):  # inside: built
        AnnotatedLabelSmoothingCriterion(task, sentence_avg=False, label_smoothing=edge)
