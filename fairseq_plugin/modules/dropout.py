"""Dropout with a cheaper mask on CPU.

"We apply dropout to the output of each sub-layer, before it is added to the sub-layer input
and normalized. In addition, we apply dropout to the sums of the embeddings and the positional
encodings" (section 5.4). During training every element is zeroed with probability p and the
survivors are scaled by 1 / (1 - p).

On CPU, ``torch.nn.functional.dropout`` draws one random number per element from a serial
generator and keeps a float mask; that is most of its cost (docs/benchmarks.md). Here
one 63-bit random integer gives four 15-bit uniform numbers, so a mask costs a quarter of the
draws, and the mask is kept as booleans (a quarter of the memory).
The drop probability is rounded to a multiple of 2^-15 (p = 0.1 becomes 0.100006) and the scale
uses the rounded value, so expectations stay exact. On other devices (CUDA's fused kernel is
fast), and where the owner asks for torch's mask (attention's ``cpu_mask=False``), this is
``torch.nn.functional.dropout``. In evaluation it does nothing, unless fairseq's
``--retain-dropout`` keeps it on.
"""

from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import PluginError
from ..torch_release import compiling

_LEVELS = 1 << 15  # a mask element compares one 15-bit slice of a random integer


def rounded_drop_probability(p: float) -> float:
    """The drop probability the CPU mask realises: p rounded to a multiple of 2^-15."""
    return round(p * _LEVELS) / _LEVELS


def is_drop_probability(p: float) -> bool:
    """0 <= p < 1, also once rounded for the CPU mask (p within 2^-16 of 1 rounds to 1)."""
    return 0.0 <= p and rounded_drop_probability(p) < 1.0


def keep_mask(shape: torch.Size, p: float, device=None) -> Tensor:
    """Booleans of ``shape``, each True (kept) with probability 1 - rounded_drop_probability(p)."""
    n = shape.numel()
    words = torch.empty((n + 3) // 4, dtype=torch.int64, device=device).random_()  # [0, 2^63)
    uniform = words.view(torch.int16)[:n] & (_LEVELS - 1)  # four uniform [0, 2^15) per word
    return (uniform >= round(p * _LEVELS)).view(shape)


class _CpuDropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, p: float) -> Tensor:
        keep = keep_mask(x.shape, p, x.device)
        ctx.scale = 1.0 / (1.0 - rounded_drop_probability(p))
        ctx.save_for_backward(keep)
        # where, not x * keep: a boolean factor would first be copied to a float tensor
        return torch.where(keep, x, 0.0).mul_(ctx.scale)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (keep,) = ctx.saved_tensors
        return torch.where(keep, grad, 0.0).mul_(ctx.scale), None


class Dropout(nn.Module):
    """``nn.Dropout`` with the cheaper CPU mask above (``cpu_mask=False``: torch's dropout on every
    device, as attention needs: its fused kernel draws its own mask).

    fairseq-generate ``--retain-dropout`` keeps it on in inference (Monte Carlo dropout), through
    fairseq's ``make_generation_fast_`` hook; ``--retain-dropout-modules`` names the owners whose
    dropout stays on (``module_name``: EmbeddingLayer, SublayerConnection,
    PositionwiseFeedForward, MultiHeadedAttention), as fairseq's own modules do."""

    def __init__(self, p: float = 0.1, module_name: Optional[str] = None, cpu_mask: bool = True):
        super().__init__()
        if cpu_mask and not is_drop_probability(p):
            raise PluginError(f"dropout probability {p} is not in [0, 1 - 2^-16)")
        if not cpu_mask and not 0.0 <= p < 1.0:
            raise PluginError(f"dropout probability {p} is not in [0, 1)")
        self.p = p
        self.module_name = module_name
        self.cpu_mask = cpu_mask
        self.retained = False  # --retain-dropout: on in inference too

    @property
    def active(self) -> bool:
        """Whether it drops anything now: in training, or in inference when retained."""
        return self.p > 0.0 and (self.training or self.retained)

    def forward(self, x: Tensor) -> Tensor:
        if not self.active:
            return x
        # torch's dropout also inside torch.compile (--compile-layers), whose generated kernels
        # draw the mask themselves, fused with the work around it
        if x.device.type != "cpu" or not self.cpu_mask or compiling():
            return F.dropout(x, self.p, training=True)
        return _CpuDropout.apply(x, self.p)

    def make_generation_fast_(self, name: str, retain_dropout: bool = False,
                              retain_dropout_modules: Optional[List[str]] = None, **unused):
        """fairseq's hook before inference (``prepare_for_inference_``): retain or not. From the
        command line the module names arrive as one string, matched as fairseq matches them
        (``in``: a name within it)."""
        self.retained = retain_dropout and (
            retain_dropout_modules is None
            or (self.module_name is not None and self.module_name in retain_dropout_modules))

    def extra_repr(self) -> str:
        return f"p={self.p}" + ("" if self.cpu_mask else ", cpu_mask=False")
