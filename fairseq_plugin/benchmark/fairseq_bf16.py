"""fairseq 0.12's fairseq-train and fairseq-generate in bf16, for the benchmark: call
``switch_on()`` in the process before fairseq's CLI parses its flags.

fairseq 0.12's --bf16 also switches on --tpu (fairseq then looks for a TPU). Switched back off,
its trainer trains in bf16 (bf16 weights, fp32 master copies in its FP16Optimizer) as it does
under fairseq-hydra-train, which leaves --tpu off. fairseq-generate has no bf16 of its own (only
--fp16's model.half()): the checkpoint's models are turned to bf16 as they load, and it says so
on stdout. Imports fairseq and torch only (not the plugin: fairseq imports that from --user-dir).
"""

import torch
from fairseq import checkpoint_utils, options

MODELS_IN_BF16 = "fairseq_bf16: the models in torch.bfloat16"


def switch_on() -> None:
    parse, load = options.parse_args_and_arch, checkpoint_utils.load_model_ensemble

    def parse_without_tpu(*args, **kwargs):
        parsed = parse(*args, **kwargs)
        parsed.tpu = False
        return parsed

    def load_in_bf16(*args, **kwargs):
        models, cfg = load(*args, **kwargs)
        print(MODELS_IN_BF16, flush=True)
        return [m.to(torch.bfloat16) for m in models], cfg

    options.parse_args_and_arch = parse_without_tpu
    checkpoint_utils.load_model_ensemble = load_in_bf16
