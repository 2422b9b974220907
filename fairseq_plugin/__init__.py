"""fairseq user-dir plugin: the Annotated Transformer (harvardnlp) inside fairseq.

``--user-dir fairseq_plugin`` (or ``import fairseq_plugin``) registers with fairseq:
the model ``annotated_transformer`` and its presets, the criterion ``annotated_label_smoothing``,
the LR scheduler ``noam`` and the task ``annotated_translation`` (fairseq's translation with
``--eval-chrf``). It also installs the plugin's changes to fairseq, each listed
with its reason in fairseq_changes.py: checkpoints that torch >= 2.6 loads and that a kill cannot
tear, one-line errors, torchrun and srun on CPUs, a save on SIGTERM/SIGUSR1, and
fairseq-interactive skipping bad input lines.
"""

from . import fairseq_changes
from .errors import PluginError

fairseq_changes.install()

from . import criterions, lr_scheduler, models, tasks  # noqa: E402,F401
from .models.annotated_transformer import AnnotatedTransformerModel  # noqa: E402,F401

__version__ = "0.1.0"
__all__ = ["AnnotatedTransformerModel", "PluginError", "__version__"]
