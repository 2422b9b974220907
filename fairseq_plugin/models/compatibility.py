"""Which checkpoints fit a model: its parameters' names and shapes, and the words its embeddings
stand for (a fingerprint of its dictionaries, kept in checkpoints as a buffer). Each refusal is
one line that says how to load the checkpoint instead.
"""

import hashlib
from typing import Dict

import torch
from torch import Tensor

from ..errors import PluginError

FINGERPRINT = "dictionary_fingerprint"  # the model's buffer: dictionary_fingerprint below


def dictionary_fingerprint(src_dict, tgt_dict):
    """(4,) int64: the source's and the target's number of types, each followed by the first 15
    hex digits of the SHA-1 of its words in order (what a token's index means). The model keeps
    it as a buffer, so checkpoints hold it: fairseq compares only the embeddings' sizes."""
    return torch.tensor([n for d in (src_dict, tgt_dict) for n in (
        len(d), int(hashlib.sha1("\n".join(d.symbols).encode()).hexdigest()[:15], 16))])


def check_dictionaries(saved, own) -> None:
    """One line where a checkpoint's fingerprint (``saved``) is not this model's (``own``)."""
    if list(saved) == list(own):
        return
    for trained, given in ((saved[0], own[0]), (saved[2], own[2])):
        if trained != given:
            raise dictionary_size_error(trained, given)
    raise PluginError("the checkpoint was trained with other dictionaries of the same size: its "
                      "tokens would be read as other words; use the data-bin (dict.*.txt) it was "
                      "trained with, or load it anyway with --model-overrides "
                      "\"{'accept_other_dictionaries': True}\"")


def dictionary_size_error(trained: int, given: int) -> PluginError:
    return PluginError(f"the checkpoint was trained with a dictionary of {trained} types but this "
                       f"data's dictionary has {given}; use the data-bin (dict.*.txt) the model "
                       f"was trained with")


def check_compatible(expected: Dict[str, Tensor], loaded: Dict[str, Tensor],
                     strict: bool = True) -> None:
    """Explain why a checkpoint's parameters do not fit this model, or return. Parameters this
    model lacks are ignored when not strict (as torch does); missing ones are refused always."""
    missing = [k for k in expected if k not in loaded]
    unexpected = [k for k in loaded if k not in expected]
    if unexpected and len(missing) > len(expected) // 2:  # before any advice about LayerNorms
        raise PluginError(
            f"the checkpoint holds another architecture's parameters (e.g. {unexpected[0]}), not "
            f"an annotated_transformer's; load it with the --arch it was trained with (its "
            f"checkpoint's cfg.model), or train this model from scratch")
    for stack in ("encoder", "decoder"):  # pre-LN's final LayerNorm: in one of them only
        final_norm = f"{stack}.norm.weight"
        if final_norm in missing or final_norm in unexpected:  # also when not strict
            trained, built = ("pre", "post") if final_norm in unexpected else ("post", "pre")
            raise PluginError(
                f"the checkpoint's {stack} is {trained}-LN but these options build a {built}-LN "
                f"{stack}; a checkpoint trained with one --*-normalize-before flag before the "
                f"flags kept fairseq's per-stack meaning is pre-LN in both stacks: load it with "
                f"--model-overrides \"{{'encoder_normalize_before': True, "
                f"'decoder_normalize_before': True}}\"")
    if missing or (unexpected and strict):
        found = (f"missing {missing[0]}" + (f", has {unexpected[0]} instead" if unexpected else "")
                 if missing else f"has {unexpected[0]}, which this model lacks")
        raise PluginError(
            f"the checkpoint does not hold this model's parameters ({found}); it was trained "
            f"with another --arch or other flags: load it with those")
    for k, v in expected.items():
        if torch.is_tensor(v) and tuple(loaded[k].shape) != tuple(v.shape):
            if k.endswith("embeddings.lut.weight") or k.endswith("generator.proj.weight"):
                raise dictionary_size_error(loaded[k].shape[0], v.shape[0])
            raise PluginError(
                f"the checkpoint's {k} has shape {tuple(loaded[k].shape)} but this model's has "
                f"{tuple(v.shape)}; it was trained with other sizes: load it with those flags")
