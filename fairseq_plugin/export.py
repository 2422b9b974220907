"""Export an ``annotated_transformer`` checkpoint as an equivalent fairseq ``transformer`` one.

The two models compute the same function on sentences within the position limits (the sinusoids
become a learned table of max_positions rows, so only the original decodes past the limit under
--match-source-len); only the parameter layout differs:

================================================  ==================================================
annotated_transformer                             fairseq transformer
================================================  ==================================================
``*.embed.embeddings.lut``                        ``*.embed_tokens``
sinusoids (notebook formula) or ``positional``    ``*.embed_positions`` (learned, rows shifted by
                                                  padding_idx + 1, as fairseq numbers positions)
``self_attn.qkv_proj`` = [W^Q; W^K; W^V]          ``self_attn.{q,k,v}_proj``
``src_attn.q_proj``, ``src_attn.kv_proj``         ``encoder_attn.q_proj``, ``encoder_attn.{k,v}_proj``
``sublayer.{0,1,2}.norm``                         ``self_attn_layer_norm``, (``encoder_attn_layer_norm``),
                                                  ``final_layer_norm``
``feed_forward.w_1``, ``w_2``                     ``fc1``, ``fc2``
``*.norm`` (pre-LN final norm)                    ``*.layer_norm`` (``--*-normalize-before``)
``decoder.generator.proj``                        ``decoder.output_projection``
================================================  ==================================================

Each stack's pre-LN maps to its ``--*-normalize-before``, post-LN (``--post-norm``) to fairseq's
default. Every parameter must find its counterpart and the exported model must
give the same logits (checked on the data's dictionaries before anything is written), otherwise
the export is refused with the reason.

The exported checkpoint holds plain containers only (no ``argparse.Namespace``), so stock
fairseq loads it with torch >= 2.6's ``weights_only`` default, without this plugin. With
``--ctranslate2 DIR`` it is also converted by CTranslate2's own fairseq converter.

    annotated-export-fairseq checkpoints/checkpoint_best.pt --output transformer.pt \\
        [--data DATA_BIN] [--ctranslate2 ct2_model] [--force]
"""

import argparse
import contextlib
import copy
import os
import shutil
import tempfile
from argparse import Namespace
from typing import Dict, NamedTuple, Optional, Tuple

import torch
from omegaconf import OmegaConf, open_dict
from torch import Tensor

from .checkpoints import HAS_ALLOWLIST, load_plain, save_whole
from .errors import PluginError, command
from .models.annotated_transformer import resolved_model_config
from .models.config import normalize_before
from .modules.embeddings import SinusoidalPositionalEncoding
from .outputs import check_ctranslate2_dir, check_output_file, check_outside

# max |logit difference| accepted between the two models, relative to the largest |logit| (at
# least 1): float32 rounding grows with the logits
TOLERANCE = 1e-4


# ---------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------

def transformer_args(ours: Namespace) -> Namespace:
    """fairseq ``transformer`` arguments equivalent to an annotated_transformer's (``ours``: its
    options, and any task options to carry along)."""
    from fairseq.models.transformer.transformer_legacy import base_architecture

    args = copy.deepcopy(ours)
    for ours_only in ("post_norm", "accept_other_dictionaries"):
        if hasattr(args, ours_only):
            delattr(args, ours_only)
    args.arch = args._name = "transformer"
    for stack in ("encoder", "decoder"):
        setattr(args, f"{stack}_normalize_before", normalize_before(ours, stack))
    positions = not ours.no_token_positional_embeddings
    # the notebook's sinusoids are not fairseq's (interleaved sin/cos): export them as a table
    args.encoder_learned_pos = args.decoder_learned_pos = positions
    for name, value in (("layernorm_embedding", False), ("no_decoder_final_norm", False),
                        ("no_cross_attention", False), ("cross_self_attention", False),
                        ("adaptive_input", False), ("adaptive_softmax_cutoff", None),
                        ("tie_adaptive_weights", False)):
        setattr(args, name, value)
    args.decoder_output_dim = args.decoder_input_dim = ours.decoder_embed_dim
    base_architecture(args)  # fairseq's own defaults for everything else
    return args


# ---------------------------------------------------------------------------------------------
# Parameters
# ---------------------------------------------------------------------------------------------

class _Mapper:
    """Copies our parameters into fairseq names and remembers which ones it used."""

    def __init__(self, ours: Dict[str, Tensor]):
        self.ours = ours
        self.used = set()
        self.out: Dict[str, Tensor] = {}

    def take(self, name: str) -> Tensor:
        if name not in self.ours:
            raise PluginError(f"cannot export: the checkpoint has no parameter {name}; it is not "
                              "an annotated_transformer checkpoint of this version")
        self.used.add(name)
        return self.ours[name]

    def copy(self, src: str, dst: str):
        self.out[dst] = self.take(src).clone()

    def linear(self, src: str, dst: str, bias: bool = True):
        self.copy(f"{src}.weight", f"{dst}.weight")
        if bias:
            self.copy(f"{src}.bias", f"{dst}.bias")

    def split(self, src: str, dsts):
        """A fused projection [W_1; W_2; ...] (rows stacked) -> one Linear per block."""
        for suffix in ("weight", "bias"):
            blocks = self.take(f"{src}.{suffix}").chunk(len(dsts), dim=0)
            for dst, block in zip(dsts, blocks):
                self.out[f"{dst}.{suffix}"] = block.clone()


def transformer_state_dict(ours: Dict[str, Tensor], args: Namespace, src_pad: int,
                           tgt_pad: int) -> Dict[str, Tensor]:
    """Our parameters under fairseq ``transformer`` names (see the module's table)."""
    m = _Mapper(ours)
    sides = (("encoder", args.encoder_layers, args.encoder_embed_dim, args.max_source_positions,
              src_pad, ("self_attn_layer_norm", "final_layer_norm")),
             ("decoder", args.decoder_layers, args.decoder_embed_dim, args.max_target_positions,
              tgt_pad, ("self_attn_layer_norm", "encoder_attn_layer_norm", "final_layer_norm")))
    for side, layers, d, max_positions, pad, norms in sides:
        m.copy(f"{side}.embed.embeddings.lut.weight", f"{side}.embed_tokens.weight")
        if not args.no_token_positional_embeddings:
            learned = f"{side}.embed.positional.embed.weight"
            if learned in ours:
                table = m.take(learned)
            else:
                # in fp32 even from a --fp16 / --bf16 checkpoint: our model computes the
                # sinusoids, exact, whatever the dtype its weights were saved in
                table = SinusoidalPositionalEncoding(d, max_positions).table(
                    torch.float32, torch.device("cpu"))
            # fairseq numbers the positions of real tokens from padding_idx + 1
            m.out[f"{side}.embed_positions.weight"] = torch.cat(
                [table.new_zeros(pad + 1, d), table], dim=0)
        for i in range(layers):
            p = f"{side}.layers.{i}"
            m.split(f"{p}.self_attn.qkv_proj", [f"{p}.self_attn.{x}_proj" for x in "qkv"])
            m.linear(f"{p}.self_attn.out_proj", f"{p}.self_attn.out_proj")
            if side == "decoder":
                m.linear(f"{p}.src_attn.q_proj", f"{p}.encoder_attn.q_proj")
                m.split(f"{p}.src_attn.kv_proj", [f"{p}.encoder_attn.{x}_proj" for x in "kv"])
                m.linear(f"{p}.src_attn.out_proj", f"{p}.encoder_attn.out_proj")
            for j, norm in enumerate(norms):
                m.linear(f"{p}.sublayer.{j}.norm", f"{p}.{norm}")
            m.linear(f"{p}.feed_forward.w_1", f"{p}.fc1")
            m.linear(f"{p}.feed_forward.w_2", f"{p}.fc2")
        if f"{side}.norm.weight" in ours:
            m.linear(f"{side}.norm", f"{side}.layer_norm")
    m.copy("decoder.generator.proj.weight", "decoder.output_projection.weight")
    left = sorted(set(ours) - m.used - {"dictionary_fingerprint"})  # (fairseq keeps none)
    if left:
        raise PluginError(f"cannot export: {left[0]} has no counterpart in fairseq's transformer")
    return m.out


# fairseq 0.12.2's encoder layers also hold copies of their attention and feed-forward weights,
# stacked for PyTorch's fused encoder layer; fairseq fills them from q/k/v_proj, out_proj, fc1 and
# fc2 whenever it loads a state dict (fairseq-fixed has none of them).
FAIRSEQ_FAST_PATH_COPIES = ("in_proj_weight", "in_proj_bias", "out_proj_weight", "out_proj_bias",
                            "fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias")


def _filled_by_fairseq(name: str) -> bool:
    return name.startswith("encoder.layers.") and name.rsplit(".", 1)[-1] in FAIRSEQ_FAST_PATH_COPIES


def load_into_transformer(model: torch.nn.Module, mapped: Dict[str, Tensor]) -> None:
    """Load mapped parameters into a fairseq TransformerModel; every parameter must be given
    (but the fast-path copies, which fairseq derives from the others as it loads them)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    missing = [k for k in params if k not in mapped and not _filled_by_fairseq(k)]
    if missing:
        raise PluginError(f"cannot export: fairseq's transformer needs {missing[0]}, which this "
                          "model has no counterpart for")
    state = model.state_dict()  # also holds fairseq's "version" buffers
    unknown = [k for k in mapped if k not in state]
    if unknown:
        raise PluginError(f"cannot export: fairseq's transformer has no parameter {unknown[0]}")
    for k, v in mapped.items():
        if tuple(state[k].shape) != tuple(v.shape):
            raise PluginError(f"cannot export: {k} has shape {tuple(v.shape)} here but "
                              f"{tuple(state[k].shape)} in fairseq's transformer")
        state[k] = v
    model.load_state_dict(state, strict=True)


# ---------------------------------------------------------------------------------------------
# Checking that both compute the same function
# ---------------------------------------------------------------------------------------------

def sample_batch(src_dict, tgt_dict, batch: int = 6, max_len: int = 12, seed: int = 0,
                 max_positions: Tuple[Optional[int], Optional[int]] = (None, None)):
    """Random sentences of different lengths, up to ``max_len`` tokens and within the model's
    (source, target) ``max_positions``: sources left-padded (as fairseq-generate batches them),
    targets right-padded (as in training). Returns net_input and the target mask."""
    g = torch.Generator().manual_seed(seed)
    src_max, tgt_max = (min(max_len, limit or max_len) for limit in max_positions)
    src_lens = torch.randint(min(2, src_max), src_max + 1, (batch,), generator=g)
    tgt_lens = torch.randint(min(2, tgt_max), tgt_max + 1, (batch,), generator=g)
    src = torch.full((batch, int(src_lens.max())), src_dict.pad())
    prev = torch.full((batch, int(tgt_lens.max())), tgt_dict.pad())
    for b in range(batch):
        n, t = int(src_lens[b]), int(tgt_lens[b])
        src[b, src.size(1) - n:-1] = torch.randint(src_dict.nspecial, len(src_dict), (n - 1,),
                                                   generator=g)
        src[b, -1] = src_dict.eos()
        prev[b, 0] = tgt_dict.eos()
        prev[b, 1:t] = torch.randint(tgt_dict.nspecial, len(tgt_dict), (t - 1,), generator=g)
    net_input = {"src_tokens": src, "src_lengths": src_lens, "prev_output_tokens": prev}
    return net_input, prev.ne(tgt_dict.pad())


@torch.no_grad()
def logit_difference(ours, theirs, src_dict, tgt_dict) -> Tuple[float, float]:
    """max |logits| difference at real target positions, teacher-forced, both in eval mode, and
    the largest |logit| of ours there."""
    ours.eval()
    theirs.eval()
    net_input, real = sample_batch(src_dict, tgt_dict, max_positions=ours.max_positions())
    a = ours(**net_input)[0][real]
    b = theirs(**net_input)[0][real]
    return float((a - b).abs().max()), float(a.abs().max())


def allowed_difference(largest: float) -> float:
    """TOLERANCE, relative to the largest |logit| (at least 1)."""
    return TOLERANCE * max(1.0, largest)


def logits_agree(diff: float, largest: float) -> bool:
    return diff <= allowed_difference(largest)


def layer_norm_placement(args: Namespace) -> str:
    """"pre-LN", "post-LN", or each stack's when they differ, of fairseq transformer ``args``."""
    pre = [getattr(args, f"{stack}_normalize_before") for stack in ("encoder", "decoder")]
    if pre[0] == pre[1]:
        return "pre-LN" if pre[0] else "post-LN"
    return f"{'pre' if pre[0] else 'post'}-LN encoder, {'pre' if pre[1] else 'post'}-LN decoder"


def fairseq_post_ln_bug(error: RuntimeError) -> bool:
    """fairseq 0.12.2's post-LN encoder fast path, with torch >= 1.13, on a padded batch."""
    return "Mask Type should be defined" in str(error)


def fairseq_cannot_run(error: RuntimeError) -> str:
    """Why the installed fairseq's own transformer cannot run the converted model."""
    import fairseq

    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return (f"fairseq {fairseq.__version__}'s transformer fails on this model ({first}); its "
            "post-LN encoder fast path breaks on padded batches in fairseq-generate too (fairseq "
            "#4858): export a model with a pre-LN encoder (trained with neither --post-norm nor "
            "--decoder-normalize-before alone), or use fairseq-fixed (Python >= 3.11)")


# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------

def _plain(value):
    """Namespaces -> dicts, recursively, so the checkpoint loads with weights_only=True."""
    if isinstance(value, Namespace):
        value = vars(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value


class Original(NamedTuple):
    """The annotated_transformer checkpoint, loaded: its state, its task (with the data-bin of
    its dictionaries) and model, and the flat options fairseq's transformer is built from."""
    state: dict
    task: object  # fairseq's translation task
    model: torch.nn.Module
    args: Namespace  # the task's and the model's options in one Namespace
    dictionaries: str  # the data-bin folder with the dict.*.txt


def export(checkpoint: str, output: str, data: Optional[str] = None,
           ctranslate2_dir: Optional[str] = None, force: bool = False, log=print) -> float:
    """Write the fairseq transformer checkpoint (and the CTranslate2 model); returns the max
    logit difference measured between the original and the export. Nothing is written before
    the export is known to give the same logits."""
    from fairseq import models

    check_paths(checkpoint, output, data, ctranslate2_dir, force)
    original = load_original(checkpoint, data)
    args = transformer_args(original.args)
    theirs = models.build_model(copy.deepcopy(args), original.task)
    load_into_transformer(theirs, transformer_state_dict(
        original.state["model"], args, original.task.source_dictionary.pad(),
        original.task.target_dictionary.pad()))
    diff = check_same_logits(original, theirs)
    log(f"annotated-export-fairseq: same logits as the original (max |diff| {diff:.1e})")
    exported = exported_checkpoint(checkpoint, args, theirs)
    if ctranslate2_dir:  # first: CTranslate2 refuses options it does not support
        to_ctranslate2(exported, original.dictionaries, ctranslate2_dir, args)
    save_whole(exported, output)  # never a half-written checkpoint
    positions = "no positions" if args.no_token_positional_embeddings else "learned positions"
    log(f"annotated-export-fairseq: wrote {output} (--arch transformer, "
        f"{layer_norm_placement(args)}, {positions})")
    if ctranslate2_dir:
        log(f"annotated-export-fairseq: wrote the CTranslate2 model {ctranslate2_dir}")
    return diff


def check_paths(checkpoint, output, data, ctranslate2_dir, force) -> None:
    """The checkpoint is there; the outputs may be written where they are asked for
    (outputs.py's rules)."""
    if not os.path.isfile(checkpoint):
        raise PluginError(f"no checkpoint at {checkpoint}; give the path of a .pt file")
    check_output_file(output, force, example="transformer.pt", inputs=[checkpoint],
                      folders=[data] if data else [])
    if ctranslate2_dir:
        check_outside("--ctranslate2", ctranslate2_dir, [data] if data else [])
        check_ctranslate2_dir(ctranslate2_dir, output, force)


def load_original(checkpoint: str, data: Optional[str]) -> Original:
    """The annotated_transformer checkpoint with its task, on the data-bin of its dictionaries
    (``data``, or the one it records); one line for another architecture or a missing data-bin."""
    from fairseq import checkpoint_utils, tasks
    from fairseq import utils as fairseq_utils

    state = checkpoint_utils.load_checkpoint_to_cpu(checkpoint)  # plugin: one-line errors
    cfg = state["cfg"]
    model_args = resolved_model_config(cfg.model) if cfg.model is not None else None
    if model_args is None:
        arch = getattr(cfg.model, "_name", None) or getattr(cfg.model, "arch", None)
        raise PluginError(f"{checkpoint} is a '{arch}' checkpoint, not an annotated_transformer "
                          "one; only annotated_transformer checkpoints can be exported")
    data = data or cfg.task.data
    if not data:
        raise PluginError(f"{checkpoint} records no data-bin; pass the one with the dict.*.txt "
                          "the model was trained with as --data")
    # fairseq's sharded data-bins (DIR1:DIR2:...) hold the same dictionaries in each: the first
    dictionaries = fairseq_utils.split_paths(data)[0]
    if not os.path.isdir(dictionaries):
        raise PluginError(f"the data-bin '{dictionaries}' (with the dict.*.txt the model was "
                          "trained with) does not exist; pass it with --data")
    task_cfg = copy.deepcopy(cfg.task)
    with open_dict(task_cfg) if OmegaConf.is_config(task_cfg) else contextlib.nullcontext():
        task_cfg.data = data
    task = tasks.setup_task(task_cfg)
    model = task.build_model(copy.deepcopy(cfg.model))
    model.load_state_dict(state["model"], strict=True)
    # one flat Namespace, as fairseq's legacy transformer and CTranslate2's converter read it
    task_options = (OmegaConf.to_container(task_cfg, resolve=True) if OmegaConf.is_config(task_cfg)
                    else dict(vars(task_cfg)))
    task_options["task"] = task_options.pop("_name", None) or task_options.get("task")
    args = Namespace(**{**task_options, **vars(model_args)})
    return Original(state, task, model, args, dictionaries)


def check_same_logits(original: Original, theirs: torch.nn.Module) -> float:
    """The max |logit difference| of the two models on a sample batch; one line when it is over
    the tolerance, or when fairseq's transformer cannot run this model."""
    task = original.task
    try:
        diff, largest = logit_difference(original.model, theirs, task.source_dictionary,
                                         task.target_dictionary)
    except RuntimeError as e:
        if not fairseq_post_ln_bug(e):
            raise  # any other failure keeps its traceback
        raise PluginError(f"cannot export: {fairseq_cannot_run(e)}") from e
    if not logits_agree(diff, largest):
        raise PluginError(f"cannot export: the converted model's logits differ by {diff:.2e} "
                          f"from the original's (more than {TOLERANCE:g} x the largest |logit|, "
                          f"at least 1: {allowed_difference(largest):.2e})")
    return diff


def exported_checkpoint(checkpoint: str, args: Namespace, theirs: torch.nn.Module) -> dict:
    """The checkpoint's own contents (read as plain containers) around the transformer's weights
    and options: no plugin, no optimizer state, fairseq's nearest criterion."""
    raw = load_plain(checkpoint)
    raw_cfg = raw["cfg"]
    raw_cfg["model"] = vars(args)
    common = dict(raw_cfg.get("common") or {})
    common["user_dir"] = None  # the export needs no plugin
    raw_cfg["common"] = common
    criterion = raw_cfg.get("criterion")
    if isinstance(criterion, dict) and criterion.get("_name") == "annotated_label_smoothing":
        # fairseq's nearest criterion, not the same loss: a cross-entropy, which reads about the
        # smoothed target's entropy higher than the notebook's KL (compare nll_loss)
        raw_cfg["criterion"] = {**criterion, "_name": "label_smoothed_cross_entropy"}
    history = [dict(h) for h in raw.get("optimizer_history", [])]
    for h in history:
        if h.get("criterion_name") == "AnnotatedLabelSmoothingCriterion":
            h["criterion_name"] = "LabelSmoothedCrossEntropyCriterion"
    return {
        "args": None,
        "cfg": _plain(raw_cfg),
        "model": theirs.state_dict(),
        "criterion": raw.get("criterion"),
        "optimizer_history": history,
        "task_state": raw.get("task_state", {}),
        # the training run's meters stay behind (under --eval-bleu they hold numpy arrays,
        # which torch's weights_only loader refuses without this plugin)
        "extra_state": {k: v for k, v in raw.get("extra_state", {}).items() if k != "metrics"},
        # no optimizer state: fine-tune an export with --reset-optimizer --reset-lr-scheduler
        "last_optimizer_state": None,
    }


def to_ctranslate2(exported: dict, data: str, output_dir: str, args: Namespace):
    """Convert with CTranslate2's own fairseq converter, into a temporary directory that then
    replaces ``output_dir`` (checked by ``check_ctranslate2_dir``): nothing is written there when
    CTranslate2 refuses the model.

    The converter reads ``cfg["model"]`` with attribute access, so it is given a copy whose
    model configuration is a Namespace, which this plugin lets torch >= 2.4 load with
    weights_only. Older torch has no allowlist: there the converter unpickles that copy fully,
    safe because it is the file written here a moment ago, in a private temporary directory.
    """
    try:
        from ctranslate2.converters import FairseqConverter
    except ImportError as e:
        raise PluginError("--ctranslate2 needs the ctranslate2 package: pip install ctranslate2"
                          ) from e
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "transformer.pt")
        torch.save({**exported, "cfg": {**exported["cfg"], "model": copy.deepcopy(args)}}, path)
        converter = FairseqConverter(path, data, source_lang=args.source_lang,
                                     target_lang=args.target_lang,
                                     unsafe_deserialization=not HAS_ALLOWLIST)
        converted = os.path.join(tmp, "ctranslate2")
        try:
            converter.convert(converted)
        except ValueError as e:  # CTranslate2 explains unsupported options in a ValueError
            reason = " ".join(str(e).split())
            raise PluginError(f"CTranslate2 cannot convert this model: {reason}; drop "
                              f"--ctranslate2 to write only the fairseq export") from e
        if os.path.isdir(output_dir):  # an earlier CTranslate2 model (check_ctranslate2_dir)
            shutil.rmtree(output_dir)
        os.makedirs(os.path.dirname(os.path.abspath(output_dir)), exist_ok=True)
        shutil.move(converted, output_dir)


@command("annotated-export-fairseq", "--output is written whole or not at all")
def main(argv=None):
    p = argparse.ArgumentParser(
        prog="annotated-export-fairseq",
        description="Convert an annotated_transformer checkpoint into an equivalent fairseq "
                    "transformer checkpoint (and optionally a CTranslate2 model).")
    p.add_argument("checkpoint", help="an annotated_transformer checkpoint (.pt)")
    p.add_argument("--output", required=True, help="where to write the transformer checkpoint")
    p.add_argument("--data", help="the data-bin with the model's dictionaries "
                                  "(default: the one recorded in the checkpoint)")
    p.add_argument("--ctranslate2", metavar="DIR",
                   help="also convert the export into a CTranslate2 model directory")
    p.add_argument("--force", action="store_true",
                   help="overwrite an existing --output (never the checkpoint) and an earlier "
                        "CTranslate2 model")
    args = p.parse_args(argv)
    export(args.checkpoint, args.output, args.data, args.ctranslate2, args.force)


if __name__ == "__main__":
    main()
