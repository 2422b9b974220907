"""Translate one sentence and draw the attention as heat-maps, as in the notebook's
"Attention Visualization": encoder self-attention, decoder self-attention and decoder-source
attention, per layer and head, labelled with the sub-word tokens.

  annotated-attention-heatmaps DATA_BIN CHECKPOINT "Ein Hund läuft über die Wiese." --out-dir maps
      [--layers 0,2] [--heads 0,1] [--beam 5]

DATA_BIN is a directory made by annotated-prepare (dictionaries, bpe.codes, prepare.json).
Writes OUT_DIR/{encoder_self,decoder_self,decoder_source}_layer{L}_head{H}.png (all layers and
heads by default). Rows are queries, columns the keys they attend to; each row sums to 1.
"""

import argparse
import os

from ..outputs import check_output_folder
from ..errors import PluginError, command
from .common import check_checkpoint, prepared_settings

KINDS = {  # file prefix -> (which stack, attention module inside a layer)
    "encoder_self": ("encoder", "self_attn"),
    "decoder_self": ("decoder", "self_attn"),
    "decoder_source": ("decoder", "src_attn"),
}


def load_hub(data_bin, checkpoint):
    from .. import AnnotatedTransformerModel

    settings = prepared_settings(data_bin)
    check_checkpoint(checkpoint)
    hub = AnnotatedTransformerModel.from_pretrained(
        os.path.dirname(os.path.abspath(checkpoint)), checkpoint_file=os.path.basename(checkpoint),
        data_name_or_path=os.path.abspath(data_bin), bpe=settings["bpe"],
        bpe_codes=os.path.join(data_bin, settings["bpe_codes"]), tokenizer=settings["tokenizer"],
        source_lang=settings["source_lang"], target_lang=settings["target_lang"])
    if not isinstance(hub.models[0], AnnotatedTransformerModel):
        raise PluginError(f"{checkpoint} holds a {type(hub.models[0]).__name__}: the heat-maps "
                          f"record this plugin's attention; give an annotated_transformer "
                          f"checkpoint")
    return hub


def require_matplotlib():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PluginError("drawing the heat-maps needs matplotlib: pip install matplotlib (or "
                          "this package's viz extra)")


def attention_maps(hub, sentence, beam=5, **generation):
    """Translate ``sentence`` (``generation``: more of fairseq's generation options, e.g.
    max_len_b=20); return (translation, source labels, decoder input labels, output labels,
    {kind: {(layer, head): weights (T_query, T_key) as a list of rows}})."""
    import torch

    from ..modules.attention import recording_attention

    model = hub.models[0]
    src = hub.encode(sentence)
    hypo = hub.generate([src], beam=beam, **generation)[0][0]["tokens"]  # ends with eos
    eos = hub.tgt_dict.eos()
    prev = torch.cat([torch.tensor([eos]), hypo[:-1]])  # teacher forcing on the translation
    with torch.no_grad(), recording_attention(model) as records:
        model(src[None], torch.tensor([src.numel()]), prev[None])
    labels = lambda d, tokens: [d[i] for i in tokens.tolist()]  # noqa: E731
    maps = {}
    for kind, (stack, attn) in KINDS.items():
        maps[kind] = {}
        layers = getattr(model, stack).layers
        for layer in range(len(layers)):
            (weights,) = records[f"{stack}.layers.{layer}.{attn}"]  # (1, h, T, S)
            for head in range(weights.size(1)):
                maps[kind][(layer, head)] = weights[0, head].tolist()
    # decoder rows are labelled with the token each query predicts; its keys are the tokens fed in
    return (hub.decode(hypo), labels(hub.src_dict, src), labels(hub.tgt_dict, prev),
            labels(hub.tgt_dict, hypo), maps)


def draw(weights, rows, cols, title, path):
    import logging

    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # fairseq logs at DEBUG
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.0 + 0.45 * len(cols), 1.0 + 0.45 * len(rows)))
    ax.imshow(weights, cmap="viridis", vmin=0.0, vmax=1.0)
    ax.set_xticks(range(len(cols)), cols, rotation=90)
    ax.set_yticks(range(len(rows)), rows)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def write_heatmaps(hub, sentence, out_dir, layers=None, heads=None, beam=5, **generation):
    """Draw the chosen maps; return (translation, {path: weights drawn})."""
    translation, src_labels, fed_labels, out_labels, maps = attention_maps(hub, sentence, beam,
                                                                           **generation)
    os.makedirs(out_dir, exist_ok=True)
    axes = {"encoder_self": (src_labels, src_labels), "decoder_self": (out_labels, fed_labels),
            "decoder_source": (out_labels, src_labels)}
    drawn = {}
    for kind, by_layer_head in maps.items():
        for (layer, head), weights in sorted(by_layer_head.items()):
            if ((layers is not None and layer not in layers)
                    or (heads is not None and head not in heads)):
                continue
            path = os.path.join(out_dir, f"{kind}_layer{layer}_head{head}.png")
            rows, cols = axes[kind]
            draw(weights, rows, cols, f"{kind.replace('_', ' ')} layer {layer} head {head}", path)
            drawn[path] = weights
    return translation, drawn


def numbers(flag: str, text: str, available: int) -> set:
    """--layers / --heads "0,2" as {0, 2}; each must be below ``available``."""
    try:
        chosen = {int(x) for x in text.split(",")}
    except ValueError:
        raise PluginError(f"{flag} {text}: give comma-separated numbers, e.g. {flag} 0,1")
    if not all(0 <= n < available for n in chosen):
        raise PluginError(f"{flag} {text}: this model has {flag[2:]} 0 to {available - 1}")
    return chosen


@command("annotated-attention-heatmaps")
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("data_bin")
    p.add_argument("checkpoint")
    p.add_argument("sentence")
    p.add_argument("--out-dir", default="attention-maps")
    p.add_argument("--layers", help="comma-separated layer numbers from 0 (default: all)")
    p.add_argument("--heads", help="comma-separated head numbers from 0 (default: all)")
    p.add_argument("--beam", type=int, default=5)
    args = p.parse_args(argv)
    if not args.sentence.strip():
        raise PluginError("the sentence is empty; give the text to translate in quotes")
    check_output_folder("--out-dir", args.out_dir, [args.data_bin], "heat-maps")
    require_matplotlib()  # before the model loads and translates
    hub = load_hub(args.data_bin, args.checkpoint)
    model = hub.models[0]
    stacks = (model.encoder.layers, model.decoder.layers)
    layers = None if args.layers is None else numbers(
        "--layers", args.layers, max(len(stack) for stack in stacks))
    heads = None if args.heads is None else numbers(
        "--heads", args.heads, max(layer.self_attn.h for stack in stacks for layer in stack))
    translation, drawn = write_heatmaps(hub, args.sentence, args.out_dir, layers, heads,
                                        args.beam)
    print(f"translation: {translation}\nwrote {len(drawn)} heat-maps to {args.out_dir}")


if __name__ == "__main__":
    main()
