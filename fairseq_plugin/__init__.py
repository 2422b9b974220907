"""fairseq user-dir plugin: the Annotated Transformer (harvardnlp) inside fairseq.

``--user-dir fairseq_plugin`` (or ``import fairseq_plugin``) registers with fairseq:
the model ``annotated_transformer`` and its presets, the criterion ``annotated_label_smoothing``
and the LR scheduler ``noam``. It also lets torch >= 2.6 load fairseq checkpoints safely, gives
user errors one line (errors.py), and lets fairseq-interactive skip bad input lines and go on.
"""

from . import checkpoints  # noqa: F401  (first: safe checkpoint loading)
from .errors import PluginError, install_excepthook, report_unknown_options_in_one_line

install_excepthook()
report_unknown_options_in_one_line()

from . import criterions, interactive, lr_scheduler, models  # noqa: E402,F401
from .models.annotated_transformer import AnnotatedTransformerModel  # noqa: E402,F401

interactive.install()

__version__ = "0.1.0"
__all__ = ["AnnotatedTransformerModel", "PluginError", "__version__"]
