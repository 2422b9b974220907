"""The Noam learning-rate schedule.

"We varied the learning rate over the course of training, according to the formula:
lrate = d_model^-0.5 * min(step_num^-0.5, step_num * warmup_steps^-1.5).
This corresponds to increasing the learning rate linearly for the first warmup_steps training
steps, and decreasing it thereafter proportionally to the inverse square root of the step number."
(Vaswani et al. 2017, section 5.3; the Annotated Transformer's ``rate`` adds a ``factor``.)
"""

import logging

from fairseq.optim.lr_scheduler import register_lr_scheduler
from fairseq.optim.lr_scheduler.fairseq_lr_scheduler import LegacyFairseqLRScheduler

from ..errors import PluginError

logger = logging.getLogger(__name__)


def noam_rate(step: int, model_dim: int, factor: float, warmup: int) -> float:
    """factor * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5); step 0 counts as step 1."""
    step = max(step, 1)
    return factor * model_dim ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)


@register_lr_scheduler("noam")
class NoamSchedule(LegacyFairseqLRScheduler):
    """Sets the learning rate after every update to ``noam_rate`` (``--lr`` is not used).

    A legacy (argparse) scheduler on purpose: it is handed all training arguments, so it can read
    d_model from the model's --encoder-embed-dim when --noam-model-dim is not given.
    """

    def __init__(self, args, optimizer):
        super().__init__(args, optimizer)
        if args.warmup_updates <= 0:
            raise PluginError(f"--warmup-updates must be positive for the noam schedule, "
                              f"got {args.warmup_updates}")
        self.model_dim = args.noam_model_dim or getattr(args, "encoder_embed_dim", None)
        if not self.model_dim:
            raise PluginError("the noam schedule needs d_model: this architecture has no "
                              "--encoder-embed-dim, so pass --noam-model-dim")
        self.factor = args.noam_factor
        self.warmup = args.warmup_updates
        logger.info(
            f"noam: lr = {self.factor} * {self.model_dim}^-0.5 * min(step^-0.5, step * "
            f"{self.warmup}^-1.5), peak {self.rate(self.warmup):.3g} at update {self.warmup} "
            f"(--lr is not used)")
        self.step_update(0)

    @staticmethod
    def add_args(parser):
        parser.add_argument("--warmup-updates", default=4000, type=int, metavar="N",
                            help="warmup_steps: the learning rate rises linearly for N updates")
        parser.add_argument("--noam-factor", default=1.0, type=float, metavar="F",
                            help="factor multiplying the whole rate (the notebook's factor)")
        parser.add_argument("--noam-model-dim", default=None, type=int, metavar="N",
                            help="d_model in the formula (default: the model's --encoder-embed-dim)")

    def rate(self, step: int) -> float:
        return noam_rate(step, self.model_dim, self.factor, self.warmup)

    def step(self, epoch, val_loss=None):
        super().step(epoch, val_loss)
        return self.optimizer.get_lr()

    def step_update(self, num_updates):
        lr = self.rate(num_updates)
        self.optimizer.set_lr(lr)
        return lr
