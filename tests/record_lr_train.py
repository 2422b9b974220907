"""fairseq-train that also prints the learning rate each update is taken with (tests only).

fairseq logs the rate set *after* an update; a resume test needs the one in the optimizer when
the update runs, so each training step first prints ``lr-used {"update": n, "lr": lr}``.
"""

import json
import sys

from fairseq.trainer import Trainer
from fairseq_cli import train

_train_step = Trainer.train_step


def train_step_printing_its_lr(self, samples, raise_oom=False):
    update = self.get_num_updates() + 1
    print("lr-used " + json.dumps({"update": update, "lr": self.get_lr()}), flush=True)
    return _train_step(self, samples, raise_oom)


Trainer.train_step = train_step_printing_its_lr

if __name__ == "__main__":
    sys.exit(train.cli_main())
