"""fairseq-train that also prints the learning rate each update is taken with (tests only).

fairseq logs the rate set *after* an update; a resume test needs the one in the optimizer when
the update runs, so each training step first prints ``lr-used {"update": n, "lr": lr}``. With
RECORD_FIRST_PARAMETERS=PATH it also saves the parameters the first update starts from (a resumed
run: those it loaded).
"""

import json
import os
import sys

import torch
from fairseq.trainer import Trainer
from fairseq_cli import train

_train_step = Trainer.train_step
_first_parameters = os.environ.get("RECORD_FIRST_PARAMETERS")


def train_step_printing_its_lr(self, samples, raise_oom=False):
    global _first_parameters
    update = self.get_num_updates() + 1
    print("lr-used " + json.dumps({"update": update, "lr": self.get_lr()}), flush=True)
    if _first_parameters:
        torch.save({k: v.detach().clone() for k, v in self.model.state_dict().items()},
                   _first_parameters)
        _first_parameters = None
    return _train_step(self, samples, raise_oom)


Trainer.train_step = train_step_printing_its_lr

if __name__ == "__main__":
    sys.exit(train.cli_main())
