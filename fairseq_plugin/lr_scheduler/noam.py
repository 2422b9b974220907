"""The Noam learning-rate schedule.

"We varied the learning rate over the course of training, according to the formula:
lrate = d_model^-0.5 * min(step_num^-0.5, step_num * warmup_steps^-1.5).
This corresponds to increasing the learning rate linearly for the first warmup_steps training
steps, and decreasing it thereafter proportionally to the inverse square root of the step number."
(Vaswani et al. 2017, section 5.3; the Annotated Transformer's ``rate`` adds a ``factor``.)
"""

import logging
from dataclasses import dataclass, field
from typing import Optional

from fairseq.dataclass import FairseqDataclass
from fairseq.optim.lr_scheduler import FairseqLRScheduler, register_lr_scheduler
from omegaconf import OmegaConf

from ..errors import PluginError
from ..reference import rate  # the notebook's formula, as it is

logger = logging.getLogger(__name__)


@dataclass
class NoamConfig(FairseqDataclass):
    warmup_updates: int = field(
        default=4000, metadata={"help": "warmup_steps: the learning rate rises linearly for N "
                                        "updates"})
    noam_factor: float = field(
        default=1.0, metadata={"help": "factor multiplying the whole rate (the notebook's factor)"})
    noam_model_dim: Optional[int] = field(
        default=None, metadata={"help": "d_model in the formula (default: the model's "
                                        "encoder_embed_dim)"})


@register_lr_scheduler("noam", dataclass=NoamConfig)
class NoamSchedule(FairseqLRScheduler):
    """Sets the learning rate after every update to the notebook's ``rate`` (``--lr`` is not
    used)."""

    def __init__(self, cfg: NoamConfig, optimizer):
        super().__init__(cfg, optimizer)
        if cfg.warmup_updates <= 0:
            raise PluginError(f"--warmup-updates must be positive for the noam schedule, "
                              f"got {cfg.warmup_updates}")
        if cfg.noam_factor <= 0:
            raise PluginError(f"--noam-factor must be positive (it multiplies the whole rate), "
                              f"got {cfg.noam_factor}")
        if cfg.noam_model_dim is not None and cfg.noam_model_dim <= 0:
            raise PluginError(f"--noam-model-dim must be positive (d_model in the formula), got "
                              f"{cfg.noam_model_dim}; or leave it out to use the model's")
        self.model_dim = cfg.noam_model_dim or model_dim_of_the_training(cfg)
        if not self.model_dim:
            raise PluginError("the noam schedule needs d_model and the model configuration has no "
                              "encoder_embed_dim: pass --noam-model-dim (lr_scheduler.noam_model_dim)")
        self.factor = cfg.noam_factor
        self.warmup = cfg.warmup_updates
        logger.info(
            f"noam: lr = {self.factor} * {self.model_dim}^-0.5 * min(step^-0.5, step * "
            f"{self.warmup}^-1.5), peak {self.rate(self.warmup):.3g} at update {self.warmup} "
            f"(--lr is not used)")
        self.step_update(0)

    def rate(self, step: int) -> float:
        return rate(step, self.model_dim, self.factor, self.warmup)

    def step(self, epoch, val_loss=None):
        super().step(epoch, val_loss)
        return self.optimizer.get_lr()

    def step_update(self, num_updates):
        lr = self.rate(num_updates)
        self.optimizer.set_lr(lr)
        return lr


def model_dim_of_the_training(cfg) -> Optional[int]:
    """d_model of the model trained with this schedule: ``model.encoder_embed_dim`` of the
    training configuration that ``cfg`` (its ``lr_scheduler`` node) belongs to, with the
    annotated_transformer presets resolved; None when there is no such value."""
    if not OmegaConf.is_config(cfg):
        # built by hand (fairseq's trainer always hands its lr_scheduler node): a Namespace of
        # all options has the model's d_model; fairseq's registry turns a Namespace into a
        # NoamConfig first, which has none (so --noam-model-dim is asked for)
        return getattr(cfg, "encoder_embed_dim", None)
    model = cfg._get_root().get("model")  # omegaconf has no public way up to the root
    if model is None:
        return None
    from ..models.annotated_transformer import resolved_model_config

    resolved = resolved_model_config(model)
    return getattr(resolved if resolved is not None else model, "encoder_embed_dim", None)
