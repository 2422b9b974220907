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
"""

import math
from dataclasses import dataclass, field

from fairseq.criterions import register_criterion
from fairseq.criterions.label_smoothed_cross_entropy import (
    LabelSmoothedCrossEntropyCriterion,
    LabelSmoothedCrossEntropyCriterionConfig,
)
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
    lprobs = lprobs.float()
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


@dataclass
class AnnotatedLabelSmoothingConfig(LabelSmoothedCrossEntropyCriterionConfig):
    label_smoothing: float = field(
        default=0.1,
        metadata={"help": "epsilon for label smoothing (the paper's eps_ls; 0 gives plain NLL)"},
    )


@register_criterion("annotated_label_smoothing", dataclass=AnnotatedLabelSmoothingConfig)
class AnnotatedLabelSmoothingCriterion(LabelSmoothedCrossEntropyCriterion):
    """fairseq's label-smoothed criterion with the Annotated Transformer's KL loss."""

    def __init__(self, task, sentence_avg, label_smoothing, ignore_prefix_size=0,
                 report_accuracy=False):
        if not 0.0 <= label_smoothing < 1.0:
            raise PluginError(f"--label-smoothing {label_smoothing} is not in [0, 1): it is the "
                              f"probability moved from the gold token to the others (e.g. 0.1)")
        super().__init__(task, sentence_avg, label_smoothing, ignore_prefix_size, report_accuracy)

    def compute_loss(self, model, net_output, sample, reduce=True):
        lprobs, target = self.get_lprobs_and_target(model, net_output, sample)
        return annotated_label_smoothing_loss(lprobs, target, self.eps, self.padding_idx,
                                              reduce=reduce)
