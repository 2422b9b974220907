"""Let torch >= 2.6 load fairseq checkpoints with ``weights_only=True``.

torch 2.6 made ``torch.load(weights_only=True)`` the default. fairseq 0.12 checkpoints store the
training configuration as an ``argparse.Namespace`` (for argparse-defined models such as this
one), which the restricted unpickler refuses ("Unsupported global: argparse.Namespace"), so
fairseq-generate, fairseq-interactive and --restore-file fail.

Rather than switching ``weights_only`` off for every ``torch.load`` in the process (or asking for
TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1), we add the few plain-data classes a fairseq checkpoint holds
to torch's allowlist. Loading stays restricted: no other global can be unpickled.
"""

import argparse

import torch

# what fairseq's trainer writes besides tensors, dicts, lists and numbers
CHECKPOINT_SAFE_GLOBALS = [argparse.Namespace]


def allow_fairseq_checkpoints() -> None:
    """Allowlist the classes above for ``torch.load(weights_only=True)`` (torch >= 2.4)."""
    add = getattr(torch.serialization, "add_safe_globals", None)
    if add is not None:
        add(CHECKPOINT_SAFE_GLOBALS)


allow_fairseq_checkpoints()
