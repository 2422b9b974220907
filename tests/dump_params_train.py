"""fairseq-train that also saves every rank's parameters (tests only).

fairseq writes checkpoints on rank 0 alone; to prove that all ranks hold the same model we
save trainer.model's parameters on every rank whenever fairseq saves a checkpoint.
"""

import os
import sys

import torch
from fairseq import checkpoint_utils
from fairseq_cli import train

_save_checkpoint = checkpoint_utils.save_checkpoint


def save_checkpoint_and_params(cfg, trainer, epoch_itr, val_loss):
    """cfg is fairseq's checkpoint config (cfg.checkpoint of the training config)."""
    os.makedirs(cfg.save_dir, exist_ok=True)
    params = {k: v.detach().clone() for k, v in trainer.get_model().state_dict().items()}
    torch.save(params, os.path.join(cfg.save_dir,
                                    f"params_rank{trainer.data_parallel_rank}.pt"))
    return _save_checkpoint(cfg, trainer, epoch_itr, val_loss)


checkpoint_utils.save_checkpoint = save_checkpoint_and_params

if __name__ == "__main__":
    sys.exit(train.cli_main())
