"""fairseq 0.12's fairseq-train and fairseq-generate in bf16, for the benchmark's
``--precision bf16`` (both models alike): two changes to fairseq, listed with the plugin's
others in fairseq_changes.py (``BENCHMARK_BF16``).

This file imports the standard library only: the benchmark's child processes load it by its
path (``install()``) without importing the plugin, whose --user-dir fairseq imports itself (and
a ``before=PLUGIN_DIR`` contestant is another checkout's plugin).
"""

import functools
import importlib

MODELS_IN_BF16 = "fairseq_changes: the models in torch.bfloat16"  # printed as they load


def parse_without_tpu(parse):
    """fairseq.options.parse_args_and_arch (fairseq_changes.py: bf16_without_tpu): fairseq 0.12's
    --bf16 also switches on --tpu (its trainer trains in bf16 under fairseq-hydra-train, which
    leaves --tpu off)."""
    @functools.wraps(parse)
    def parse_args_and_arch(*args, **kwargs):
        parsed = parse(*args, **kwargs)
        parsed.tpu = False
        return parsed
    return parse_args_and_arch


def load_in_bf16(load):
    """fairseq.checkpoint_utils.load_model_ensemble (fairseq_changes.py: generate_in_bf16): the
    models turned to bf16 as they load (fairseq-generate 0.12 has only --fp16's model.half())."""
    @functools.wraps(load)
    def load_model_ensemble(*args, **kwargs):
        import torch  # (this file imports the standard library only)

        models, cfg = load(*args, **kwargs)
        print(MODELS_IN_BF16, flush=True)
        return [m.to(torch.bfloat16) for m in models], cfg
    return load_model_ensemble


# (module, attribute, wrapper)
CHANGES = (("fairseq.options", "parse_args_and_arch", parse_without_tpu),
           ("fairseq.checkpoint_utils", "load_model_ensemble", load_in_bf16))


def install() -> None:
    """Both changes, in a child process of the benchmark (for good: it ends with the command)."""
    for module, attribute, wrapper in CHANGES:
        owner = importlib.import_module(module)
        setattr(owner, attribute, wrapper(getattr(owner, attribute)))
