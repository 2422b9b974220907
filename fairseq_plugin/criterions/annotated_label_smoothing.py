"""Label smoothing as in the Annotated Transformer: KL divergence to a smoothed target.

"During training, we employed label smoothing of value eps_ls = 0.1. This hurts perplexity, as
the model learns to be more unsure, but improves accuracy and BLEU score." (section 5.4)

The notebook's target distribution puts 1 - eps on the gold token, eps / (V - 2) on every other
token except padding, and 0 on the padding column; rows whose target is padding are all zero.
The loss is KL(target || model) summed over tokens (``nn.KLDivLoss(reduction="sum")``); the
notebook's class, written out, is ``fairseq_plugin.reference.LabelSmoothing``, which the tests
hold this closed form equal to.
fairseq's ``label_smoothed_cross_entropy`` differs: a cross-entropy (which is the KL plus the
target's entropy) to eps / (V - 1) on every token but the gold one, padding included. The two
losses are not comparable number for number; ``nll_loss`` (and so perplexity) is.

We subclass fairseq's criterion for everything but the loss: the same flags
(--label-smoothing, --report-accuracy, --ignore-prefix-size, --sentence-avg), logging and metric
reduction.

Speed: when the model's log-probabilities are the log-softmax of its logits (this plugin's model),
the loss is taken from the logits with its gradient written out (``SmoothedLossFromLogits``):
the same loss, one pass over the (N, V) logits in backward where autograd makes several.
``--plain-loss`` keeps autograd's gradient through ``annotated_label_smoothing_loss``, which the
tests hold the fused one equal to.
"""

import math
from dataclasses import dataclass, field

import torch
from fairseq.criterions import register_criterion
from fairseq.criterions.label_smoothed_cross_entropy import (
    LabelSmoothedCrossEntropyCriterion,
    LabelSmoothedCrossEntropyCriterionConfig,
)
from fairseq.models import BaseFairseqModel, FairseqDecoder
from torch import Tensor

from ..errors import PluginError


def _xlogx(x: float) -> float:
    return x * math.log(x) if x > 0 else 0.0


def annotated_label_smoothing_loss(lprobs: Tensor, target: Tensor, eps: float, padding_idx: int,
                                   reduce: bool = True):
    """KL(q || p) with the notebook's smoothed q, without building the (N, V) matrix q.

    lprobs (N, V) log-probabilities, target (N,). Per non-padding token, with g the gold token,
    u = eps / (V - 2) and sum_j over all tokens:
        KL = sum_j q_j log q_j - sum_j q_j log p_j
           = (1-eps) log(1-eps) + eps log u  -  (1-eps) log p_g  -  u (sum_j log p_j - log p_g - log p_pad)
    Returns (loss, nll_loss), summed over tokens if reduce, else per token (N,).
    """
    V = lprobs.size(-1)
    u = eps / (V - 2)
    if lprobs.dtype in (torch.float16, torch.bfloat16):
        lprobs = lprobs.float()  # summed over V: in fp32
    gold = lprobs.gather(-1, target.unsqueeze(-1)).squeeze(-1)  # log p_g, (N,)
    others = lprobs.sum(-1) - gold - lprobs[:, padding_idx]  # sum over j not in {g, pad}
    entropy_term = _xlogx(1.0 - eps) + (V - 2) * _xlogx(u)  # sum_j q_j log q_j
    loss = entropy_term - (1.0 - eps) * gold - u * others
    nll_loss = -gold
    padding = target.eq(padding_idx)  # rows that count nothing, whatever their lprobs
    loss = loss.masked_fill(padding, 0.0)
    nll_loss = nll_loss.masked_fill(padding, 0.0)
    if reduce:
        return loss.sum(), nll_loss.sum()
    return loss, nll_loss


class SmoothedLossFromLogits(torch.autograd.Function):
    """``annotated_label_smoothing_loss(log_softmax(logits), ...)`` per token, (loss, nll_loss),
    with its gradient written out. For a real token with gold g, p = softmax(logits) and the
    smoothed target q (which sums to one):
        d KL / d logits = p - q,    d NLL / d logits = p - onehot(g);
    a padding row's loss is zero, and so is its gradient. Autograd would fill one (N, V) gradient
    for the gather, add it to the row sums', then run the log-softmax's backward; this makes one
    from p."""

    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, eps: float, padding_idx: int):
        # fp16/bf16 logits: log-softmax in fp32, as fairseq's get_normalized_probs
        half = logits.dtype in (torch.float16, torch.bfloat16)
        lprobs = (logits.float() if half else logits).log_softmax(dim=-1)  # (N, V)
        loss, nll_loss = annotated_label_smoothing_loss(lprobs, target, eps, padding_idx,
                                                        reduce=False)
        ctx.save_for_backward(lprobs, target)
        ctx.eps, ctx.padding_idx, ctx.logits_dtype = eps, padding_idx, logits.dtype
        ctx.set_materialize_grads(False)  # nll_loss is usually only logged: no gradient
        return loss, nll_loss

    @staticmethod
    def backward(ctx, d_loss, d_nll):
        lprobs, target = ctx.saved_tensors
        eps, padding_idx = ctx.eps, ctx.padding_idx
        u = eps / (lprobs.size(-1) - 2)
        real = target.ne(padding_idx).to(lprobs.dtype)  # (N,)
        a = (d_loss if d_loss is not None else torch.zeros_like(real)) * real  # (N,)
        b = (d_nll if d_nll is not None else torch.zeros_like(real)) * real
        # a (p - q) + b (p - onehot(g)), q = u everywhere, 1 - eps at g, 0 at the padding column
        au = a * u
        grad = lprobs.exp().mul_((a + b)[:, None]).sub_(au[:, None])  # (N, V)
        grad[:, padding_idx] += au
        grad.scatter_add_(1, target[:, None], -(a * (1.0 - eps - u) + b)[:, None])
        return grad.to(ctx.logits_dtype), None, None, None


def log_softmax_of_logits(model) -> bool:
    """Whether ``model.get_normalized_probs(net_output, log_probs=True)`` is fairseq's default,
    the log-softmax of ``net_output[0]`` (no adaptive softmax, no method overridden): then the
    loss may be taken from the logits. A DDP wrapper is looked through."""
    while not isinstance(model, BaseFairseqModel) and hasattr(model, "module"):
        model = model.module
    decoder = getattr(model, "decoder", None)
    return (isinstance(model, BaseFairseqModel) and isinstance(decoder, FairseqDecoder)
            and getattr(decoder, "adaptive_softmax", None) is None
            and all(getattr(type(obj), name) is getattr(base, name)
                    for obj, base in ((model, BaseFairseqModel), (decoder, FairseqDecoder))
                    for name in ("get_normalized_probs", "get_normalized_probs_scriptable")))


@dataclass
class AnnotatedLabelSmoothingConfig(LabelSmoothedCrossEntropyCriterionConfig):
    label_smoothing: float = field(
        default=0.1,
        metadata={"help": "epsilon for label smoothing (the paper's eps_ls; 0 gives plain NLL)"},
    )
    plain_loss: bool = field(
        default=False,
        metadata={"help": "the loss's gradient through autograd (log-softmax, then the closed "
                          "form) instead of written out from the logits: slower, the reference"},
    )


@register_criterion("annotated_label_smoothing", dataclass=AnnotatedLabelSmoothingConfig)
class AnnotatedLabelSmoothingCriterion(LabelSmoothedCrossEntropyCriterion):
    """fairseq's label-smoothed criterion with the Annotated Transformer's KL loss."""

    def __init__(self, task, sentence_avg, label_smoothing, ignore_prefix_size=0,
                 report_accuracy=False, plain_loss=False):
        if not 0.0 <= label_smoothing < 1.0:
            raise PluginError(f"--label-smoothing {label_smoothing} is not in [0, 1): it is the "
                              f"probability moved from the gold token to the others (e.g. 0.1)")
        super().__init__(task, sentence_avg, label_smoothing, ignore_prefix_size, report_accuracy)
        self.plain_loss = plain_loss

    def compute_loss(self, model, net_output, sample, reduce=True):
        if self.plain_loss or not log_softmax_of_logits(model):
            lprobs, target = self.get_lprobs_and_target(model, net_output, sample)
            return annotated_label_smoothing_loss(lprobs, target, self.eps, self.padding_idx,
                                                  reduce=reduce)
        logits, target = net_output[0], model.get_targets(sample, net_output)  # (B, T, V), (B, T)
        prefix = self.ignore_prefix_size  # --ignore-prefix-size: not scored
        logits, target = logits[:, prefix:], target[:, prefix:]
        loss, nll_loss = SmoothedLossFromLogits.apply(
            logits.reshape(-1, logits.size(-1)), target.reshape(-1), self.eps, self.padding_idx)
        return (loss.sum(), nll_loss.sum()) if reduce else (loss, nll_loss)
