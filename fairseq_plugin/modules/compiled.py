"""Speed, kept apart from the model: the layers compiled with torch.compile for full passes.

With ``--compile-layers`` each encoder and decoder layer's forward is compiled (torch.compile,
dynamic shapes) for the passes over whole sentences: training's, validation's, and the encoder's
at generation; incremental decoding's steps call the same layers uncompiled. The compiled code is the code of layers.py and
attention.py, read as it stands: TorchDynamo traces it into one graph per layer and TorchInductor
fuses its element-wise work (dropout, residual additions, layer norms, the activation) into a
few kernels. A new batch shape does not recompile (the lengths are symbolic); what recompiles is
a new *kind* of call — training or evaluation, a source mask or none, packed rows or the whole
batch, the layer that returns its attention weights — a handful per layer (tested bound).
The results are the eager layers' (tested: loss and every gradient, fp32). On 2 CPU cores it
was slower than eager (docs/benchmarks.md, "Compiled layers"): off by default.
"""

from typing import Callable, List, Sequence

import torch
from torch import nn


class CompiledLayers:
    """The layers of one stack, each with its compiled forward; ``layers[i](...)`` runs layer i
    compiled. Not a module: the layers' parameters stay where the stack keeps them."""

    def __init__(self, layers: Sequence[nn.Module]):
        self.calls: List[Callable] = [torch.compile(layer, dynamic=True) for layer in layers]

    def __iter__(self):
        return iter(self.calls)

    def __len__(self) -> int:
        return len(self.calls)
