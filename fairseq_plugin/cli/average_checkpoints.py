"""Average the parameters of several fairseq checkpoints into one.

fairseq's pip package does not ship its averaging script; this is our own. Averaging the last
few checkpoints of a run usually gains a little BLEU (Vaswani et al. 2017, section 6.1: "we used
a single model obtained by averaging the last 5 checkpoints").

  annotated-average-checkpoints --inputs DIR --num-epoch-checkpoints 5 --output avg.pt
  annotated-average-checkpoints --inputs DIR --num-update-checkpoints 5 --output avg.pt
  annotated-average-checkpoints --inputs a.pt b.pt c.pt --output avg.pt

The result is the input trained longest (the most updates; of equals, the last listed) with its
model parameters replaced by the element-wise mean, so fairseq-generate, fairseq-interactive and
--restore-file load it like any checkpoint.
"""

import argparse
import collections
import os
import re

import torch

from ..checkpoints import load_plain, save_whole
from ..outputs import check_output_file
from ..errors import PluginError, command


def _arch(state):
    cfg = state.get("cfg") or {}
    model_cfg = cfg.get("model") if isinstance(cfg, dict) else None
    if model_cfg is None and state.get("args") is not None:
        model_cfg = state["args"]
    if model_cfg is None:
        return None
    if isinstance(model_cfg, dict):
        return model_cfg.get("arch") or model_cfg.get("_name")
    return getattr(model_cfg, "arch", None) or getattr(model_cfg, "_name", None)


def load(path):
    try:  # as fairseq loads a checkpoint: its classes and --eval-bleu's numpy counts allowed
        state = load_plain(path)
    except FileNotFoundError:
        raise PluginError(f"no checkpoint at {path}")
    except Exception as e:
        raise PluginError(f"cannot read checkpoint {path} ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}); is it a complete "
                          f"fairseq checkpoint?")
    if not isinstance(state, dict) or "model" not in state:
        raise PluginError(f"{path} is not a fairseq checkpoint (no 'model' entry)")
    return state


def _updates(state) -> int:
    history = state.get("optimizer_history") or [{}]
    return history[-1].get("num_updates", 0)


def average(paths):
    """Element-wise mean of the models in ``paths``; returns it in the state of the input trained
    longest (its epoch, data iterator and optimizer, for --restore-file)."""
    if len(paths) < 1:
        raise PluginError("no checkpoints to average")
    total = None
    first_path, first_arch, shapes = None, None, None
    newest = None
    for path in paths:
        state = load(path)
        if newest is None or _updates(state) >= _updates(newest):
            newest = state
        arch = _arch(state)
        params = state["model"]
        these = {k: tuple(v.shape) for k, v in params.items()}
        if total is None:
            first_path, first_arch, shapes = path, arch, these
            total = collections.OrderedDict(
                (k, v.double().clone() if floating(v) else v.clone()) for k, v in params.items())
            continue
        if arch != first_arch:
            raise PluginError(f"cannot average checkpoints of different architectures: "
                              f"{first_path} is {first_arch}, {path} is {arch}")
        if these != shapes:
            diff = sorted(set(these.items()) ^ set(shapes.items()))[:3]
            raise PluginError(f"cannot average {first_path} and {path}: their parameters "
                              f"differ (e.g. {diff}); they are not the same model")
        for k, v in params.items():
            if floating(v):
                total[k] += v.double()
            elif not torch.equal(v, total[k]):  # e.g. the fingerprint of the dictionaries
                raise PluginError(f"cannot average {first_path} and {path}: their {k} differ; "
                                  f"they are not the same model")
    n = len(paths)
    reference = newest["model"]  # its dtypes
    newest["model"] = collections.OrderedDict(
        (k, (v / n).to(reference[k].dtype) if floating(v) else v)
        for k, v in total.items())
    return newest


def floating(value) -> bool:
    return torch.is_tensor(value) and value.is_floating_point()


def last_checkpoints(directory, n, by_update=False):
    """The n newest checkpointEPOCH.pt (or checkpoint_EPOCH_UPDATE.pt) files in directory."""
    pattern = re.compile(r"checkpoint_\d+_(\d+)\.pt$" if by_update else r"checkpoint(\d+)\.pt$")
    found = []
    for name in os.listdir(directory):
        m = pattern.fullmatch(name)
        if m:
            found.append((int(m.group(1)), os.path.join(directory, name)))
    if len(found) < n:
        kind = "update (checkpoint_E_U.pt)" if by_update else "epoch (checkpointN.pt)"
        raise PluginError(f"asked for the last {n} {kind} checkpoints but {directory} has "
                          f"{len(found)}; train with --save-interval-updates / without "
                          f"--no-epoch-checkpoints, or average fewer")
    return [path for _, path in sorted(found)[-n:]]


@command("annotated-average-checkpoints", "--output is written whole or not at all")
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--inputs", nargs="+", required=True,
                   help="checkpoint files, or one directory with --num-*-checkpoints")
    p.add_argument("--output", required=True, help="where to write the averaged checkpoint")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--num-epoch-checkpoints", type=int, help="average the last N epochs")
    group.add_argument("--num-update-checkpoints", type=int, help="average the last N updates")
    p.add_argument("--force", action="store_true",
                   help="overwrite --output if it exists (never one of the inputs)")
    args = p.parse_args(argv)

    by_update = args.num_update_checkpoints is not None
    n = args.num_update_checkpoints if by_update else args.num_epoch_checkpoints
    directories = [path for path in args.inputs if os.path.isdir(path)]
    if n is not None:
        flag = "--num-update-checkpoints" if by_update else "--num-epoch-checkpoints"
        if n < 1:
            p.error(f"{flag} {n}: average at least 1 checkpoint")
        if len(args.inputs) != 1:
            p.error(f"{flag} takes one directory in --inputs, not {len(args.inputs)} paths")
        if not directories:
            p.error(f"{flag}: {args.inputs[0]} is no directory; give the --save-dir of "
                    f"the training")
        paths = last_checkpoints(args.inputs[0], n, by_update)
    elif directories:
        p.error(f"{directories[0]} is a directory: add --num-epoch-checkpoints N or "
                f"--num-update-checkpoints N to average its last N checkpoints")
    else:
        paths = args.inputs
    check_output_file(args.output, args.force, example="checkpoint_avg.pt", inputs=paths)
    save_whole(average(paths), args.output)  # never a half-written checkpoint
    print(f"averaged {len(paths)} checkpoints into {args.output}:")
    for path in paths:
        print(f"  {path}")


if __name__ == "__main__":
    main()
