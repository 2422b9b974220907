# ---
# jupyter:
#   jupytext:
#     formats: py:percent,ipynb
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # The Annotated Transformer, run through fairseq
#
# This walkthrough follows the sections of harvardnlp's
# [*The Annotated Transformer*](https://nlp.seas.harvard.edu/annotated-transformer/), but runs
# them on this package: the notebook's model written plainly (`fairseq_plugin/reference.py`),
# the same model as a fairseq plugin (`fairseq_plugin/models`, `modules`), and fairseq's own
# commands for training, beam search and scoring.
#
# At each concept it shows the plain class and the plugin's class, and checks that they give
# the same numbers on the same input. The figures are written as PNG files next to this file
# (`figures/`). It runs top to bottom in a few minutes on 2 CPU cores; set
# `WALKTHROUGH_FULL=1` for longer training and better translations.
#
# Open it with `make walkthrough`, or run it with `jupytext --execute`.

# %%
import inspect
import logging
import os
import shutil
import subprocess
import sys
from argparse import Namespace
from types import SimpleNamespace

logging.getLogger("fairseq").setLevel(logging.WARNING)  # its import notes on optional packages
logging.getLogger("matplotlib").setLevel(logging.WARNING)  # its font search
import matplotlib.pyplot as plt  # noqa: E402  (Jupyter shows each figure below its cell)
import numpy as np  # noqa: E402
import torch  # noqa: E402
from fairseq.data import Dictionary  # noqa: E402
from fairseq.models import MODEL_REGISTRY  # noqa: E402

import fairseq_plugin  # noqa: E402  (registers the model, criterion and schedule)
from fairseq_plugin import reference  # noqa: E402
from fairseq_plugin.reference_weights import load_plain_weights, plain_attention, plain_model  # noqa: E402,E501

FULL = os.environ.get("WALKTHROUGH_FULL") == "1"


def find_repository(start):
    """The checkout this walkthrough belongs to (its bundled Tatoeba sample is used below)."""
    path = os.path.abspath(start)
    while not os.path.isdir(os.path.join(path, "examples", "tatoeba", "data")):
        if os.path.dirname(path) == path:
            raise RuntimeError(f"no examples/tatoeba/data above {start}: run the walkthrough "
                               "from examples/walkthrough of this package's checkout")
        path = os.path.dirname(path)
    return path


REPO = find_repository(os.getcwd())  # Jupyter runs in examples/walkthrough
HERE = os.path.abspath(os.environ.get("WALKTHROUGH_DIR", "."))  # where figures and work go
FIGURES = os.path.join(HERE, "figures")
WORK = os.path.join(HERE, "work")
for made in ("copy", "tatoeba"):  # an earlier run's data and models: each run starts afresh
    shutil.rmtree(os.path.join(WORK, made), ignore_errors=True)
os.makedirs(FIGURES, exist_ok=True)
BIN = os.path.dirname(sys.executable)  # fairseq's commands beside this Python
torch.manual_seed(0)


def show_source(*objects):
    """Print the source of each object, one after the other."""
    for obj in objects:
        print(f"# {obj.__module__}.{obj.__qualname__}")
        print(inspect.getsource(obj))


def agree(name, a, b, tolerance=1e-5):
    """Print, and check, the largest difference between two results."""
    diff = (a - b).abs().max().item()
    print(f"{name}: max |difference| = {diff:.2e}")
    assert diff < tolerance, name


def save(fig, name):
    """Write a figure, after checking that it draws something: every line and image holds
    data, all of it finite (a NaN draws nothing, and a blank figure would pass unseen)."""
    for ax in fig.axes:
        for artist in [*ax.get_lines(), *ax.get_images()]:
            data = artist.get_ydata() if hasattr(artist, "get_ydata") else artist.get_array()
            data = np.asarray(data, dtype=float)
            assert data.size and np.isfinite(data).all(), f"{name}: empty or not finite data"
    path = os.path.join(FIGURES, name)
    fig.savefig(path, dpi=80, bbox_inches="tight")
    print("wrote", os.path.relpath(path, HERE))


def run(*command):
    """Run one of fairseq's (or this package's) commands; print its last lines."""
    out = subprocess.run([os.path.join(BIN, command[0]), *map(str, command[1:])],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{command[0]} failed:\n{out.stderr[-3000:]}")
    return out.stdout


# a small model of the plugin, and its plain twin with the same weights
dictionary = Dictionary()
for i in range(20):
    dictionary.add_symbol(f"w{i}")
dictionary.finalize(padding_factor=1)
task = SimpleNamespace(source_dictionary=dictionary, target_dictionary=dictionary)
fast = MODEL_REGISTRY["annotated_transformer_tiny"].build_model(Namespace(), task).eval()
plain = plain_model(fast)
PAD, EOS = dictionary.pad(), dictionary.eos()

# %% [markdown]
# ## Background
#
# The Transformer (Vaswani et al., 2017) replaces recurrence with attention: every position of
# a sentence looks at every other in one step. Like most neural sequence transduction models it
# has an encoder-decoder structure: the encoder maps the source to a sequence of continuous
# representations (the "memory"), and the decoder generates the target one token at a time
# from it.
#
# ## Model architecture
#
# The plain `EncoderDecoder` has the notebook's `encode` and `decode`; the plugin's model is a
# fairseq `FairseqEncoderDecoderModel` whose encoder and decoder do the same.

# %%
show_source(reference.EncoderDecoder)

# %% [markdown]
# ### Encoder and decoder stacks
#
# Each stack is N identical layers (`clones`). In every layer a residual connection wraps each
# sub-layer, with layer normalisation: the notebook normalises first (pre-LN) and ends the stack
# with a final LayerNorm; the paper normalises after the residual (post-LN, `--post-norm`).

# %%
from fairseq_plugin.modules import layers  # noqa: E402

show_source(reference.SublayerConnection, layers.SublayerConnection)

# %%
x = torch.randn(2, 7, 64)
mask = torch.ones(2, 1, 7, dtype=torch.bool)
mask[1, :, 5:] = False  # the second sentence has 5 real tokens
agree("encoder layer, plain vs plugin",
      plain.encoder.layers[0](x, mask)[:, :5], fast.encoder.layers[0](x, mask[:, None])[:, :5])

# %% [markdown]
# ## Attention
#
# Attention(Q, K, V) = softmax(QK^T / √d_k) V. Masks say where a query may look: the
# decoder's self-attention may not look ahead (`subsequent_mask`), and no query looks at
# padding.

# %%
fig, axes = plt.subplots(1, 2, figsize=(8, 4))
axes[0].imshow(reference.subsequent_mask(20)[0])
axes[0].set_title("subsequent_mask(20)")
tgt = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12], [5, 6, 7, 8, 9, PAD, PAD, PAD]])
axes[1].imshow(reference.tgt_mask_of(tgt, PAD)[1])
axes[1].set_title("target mask, 5 tokens + padding")
for ax in axes:
    ax.set_xlabel("key position")
    ax.set_ylabel("query position")
save(fig, "masks.png")

# %% [markdown]
# Multi-head attention projects queries, keys and values h times, attends in each head, then
# concatenates the heads and projects with W^O. The plain class keeps four matrices; the
# plugin stores W^Q, W^K, W^V side by side (one matrix product) and runs torch's fused kernel.

# %%
from fairseq_plugin.modules.attention import MultiHeadedAttention  # noqa: E402

show_source(reference.MultiHeadedAttention.forward, MultiHeadedAttention.forward)
fast_attn = fast.encoder.layers[0].self_attn
out_fast, _ = fast_attn(x, mask=mask[:, None])
out_plain, _ = plain_attention(fast_attn)(x, x, x, mask)
agree("multi-head self-attention, plain vs plugin", out_plain[:, :5], out_fast[:, :5])

# %% [markdown]
# ## Position-wise feed-forward networks
#
# FFN(x) = max(0, xW_1 + b_1)W_2 + b_2, at each position on its own.

# %%
show_source(reference.PositionwiseFeedForward, layers.PositionwiseFeedForward)
agree("feed-forward, plain vs plugin", plain.encoder.layers[0].feed_forward(x),
      fast.encoder.layers[0].feed_forward(x))

# %% [markdown]
# ## Embeddings and positional encoding
#
# Embeddings are multiplied by √d_model; sinusoids of different frequencies encode each
# position.

# %%
from fairseq_plugin.modules import embeddings  # noqa: E402

show_source(reference.Embeddings, embeddings.Embeddings, reference.positional_encoding,
            embeddings.sinusoid_table)
agree("sinusoids, plain (float64) vs plugin (float32)",
      reference.positional_encoding(100, 64).float(), embeddings.sinusoid_table(100, 64))
pe = reference.positional_encoding(100, 20)
fig, ax = plt.subplots(figsize=(8, 3))
for dim in (4, 5, 6, 7):
    ax.plot(pe[:, dim], label=f"dimension {dim}")
ax.set_xlabel("position")
ax.legend()
save(fig, "positional_encoding.png")

# %% [markdown]
# ## The full model
#
# `make_model` builds the whole model from its hyper-parameters and initialises every matrix
# with Glorot / fan_avg. The notebook's small example: 2 layers, vocabularies of 11. (The
# plugin draws its token embeddings from N(0, d_model^-0.5) instead, as fairseq's transformer
# does, so that scaled by sqrt(d_model) they start at the positional encodings' size; with the
# notebook's Glorot, `--embedding-init glorot`, the Tatoeba model below learns markedly slower.
# Its linear maps also start as fairseq's transformer draws them, which learned better on real
# text; `--linear-init glorot` gives the notebook's: docs/code-map.md.)

# %%
small = reference.make_model(11, 11, N=2)
print(f"make_model(11, 11, N=2): {sum(p.numel() for p in small.parameters()):,} parameters")

# The plain model's weights, loaded into the plugin's model, give the same log-probabilities.
notebook = reference.make_model(len(dictionary), len(dictionary), N=2, d_model=64, d_ff=256,
                                h=4).eval()
twin = MODEL_REGISTRY["annotated_transformer_tiny"].build_model(Namespace(), task).eval()
load_plain_weights(twin, notebook)
src = torch.tensor([[7, 8, 9, 10, 11, EOS], [12, 13, 14, EOS, PAD, PAD]])
prev = torch.tensor([[EOS, 5, 6, 7, 8], [EOS, 9, 10, PAD, PAD]])
with torch.no_grad():
    lp_plain = notebook.generator(notebook(src, prev, reference.src_mask_of(src, PAD),
                                           reference.tgt_mask_of(prev, PAD)))
    # fairseq pads sources on the left; positions count real tokens, so the encoding is the same
    left = torch.tensor([[7, 8, 9, 10, 11, EOS], [PAD, PAD, 12, 13, 14, EOS]])
    lp_fast = twin.get_normalized_probs(twin(left, torch.tensor([6, 4]), prev), log_probs=True)
real = prev.ne(PAD)
agree("whole model, log-probabilities", lp_plain[real], lp_fast[real])

# %% [markdown]
# ## Training
#
# ### Batches and masks
#
# fairseq's data pipeline makes the batches: sources left-padded, targets shifted right behind
# an end-of-sentence token (`prev_output_tokens`), grouped by length up to `--max-tokens`. The
# masks above come from those tokens.
#
# ### Label smoothing
#
# The target puts 1 − ε on the gold token and spreads ε over the rest (not on padding); the loss
# is the KL divergence to it. The plugin's criterion computes the same without building the
# (N, V) matrix.
#
# The second figure is the notebook's: a prediction ever surer of the right token. Its loss is
# lowest where the prediction gives that token 1 − ε = 0.9 (x = 27), and rises beyond: label
# smoothing punishes over-confidence. (The notebook's own figure is blank: its `nn.KLDivLoss`
# returns NaN where the model gives padding probability 0; `reference.LabelSmoothing` counts
# nothing there.)

# %%
from fairseq_plugin.criterions.annotated_label_smoothing import annotated_label_smoothing_loss  # noqa: E402,E501

smoothing = reference.LabelSmoothing(vocab_size=5, padding_idx=0, smoothing=0.4)
fig, ax = plt.subplots(figsize=(4, 3))
ax.imshow(smoothing.target_distribution(torch.tensor([2, 1, 0, 3, 3])))
ax.set_title("smoothed targets (ε = 0.4)")
save(fig, "label_smoothing.png")

lprobs = torch.randn(30, 40, dtype=torch.float64).log_softmax(-1)
target = torch.randint(2, 40, (30,))
target[::5] = PAD
agree("label smoothing, plain vs plugin",
      reference.LabelSmoothing(40, PAD, 0.1)(lprobs, target),
      annotated_label_smoothing_loss(lprobs, target, 0.1, PAD)[0].double())


def loss_of(x):  # a prediction that grows more confident in the right token
    d = x + 3
    predict = torch.tensor([[0, x / d, 1 / d, 1 / d, 1 / d]]).log()
    return reference.LabelSmoothing(5, 0, 0.1)(predict, torch.tensor([1])).item()


fig, ax = plt.subplots(figsize=(5, 3))
ax.plot(range(1, 100), [loss_of(x) for x in range(1, 100)])
ax.set_xlabel("confidence in the right token")
ax.set_ylabel("loss")
save(fig, "label_smoothing_loss.png")

# %% [markdown]
# ### The Noam schedule
#
# lrate = factor · d_model^−0.5 · min(step^−0.5, step · warmup^−1.5): a linear warm-up, then
# decay with the inverse square root of the step. The plugin's `--lr-scheduler noam` sets the
# optimizer's rate to the same formula after every update.

# %%
from fairseq.optim import FairseqOptimizer  # noqa: E402

from fairseq_plugin.lr_scheduler.noam import NoamSchedule  # noqa: E402

show_source(reference.rate, NoamSchedule.rate)


class OneParameter(FairseqOptimizer):
    """A stand-in for fairseq's optimizer: the schedule sets its learning rate."""

    def __init__(self):
        super().__init__(cfg=None)
        self._optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)


optimizer = OneParameter()
schedule = NoamSchedule(Namespace(warmup_updates=4000, noam_factor=1.0, noam_model_dim=None,
                                  encoder_embed_dim=512), optimizer)
steps = range(1, 20000, 50)
set_rates = []
for s in steps:
    schedule.step_update(s)
    set_rates.append(optimizer.get_lr())
agree("Noam, plain rate vs the plugin's learning rates",
      torch.tensor([reference.rate(s, 512, 1, 4000) for s in steps], dtype=torch.float64),
      torch.tensor(set_rates, dtype=torch.float64))
fig, ax = plt.subplots(figsize=(6, 3))
for d_model, factor, warmup in ((512, 1, 4000), (512, 1, 8000), (256, 1, 4000)):
    ax.plot([reference.rate(s, d_model, factor, warmup) for s in range(1, 20000, 50)],
            label=f"d_model {d_model}, warmup {warmup}")
ax.set_xlabel("step (x50)")
ax.legend()
save(fig, "noam.png")

# %% [markdown]
# ## A first example: copying symbols
#
# The notebook's first task: given random symbols from a small vocabulary, output the same
# symbols. `annotated-copy-data` writes it as text, fairseq's commands do the rest: binarise,
# train the plugin's `annotated_transformer_tiny` with label smoothing and Noam, decode.

# %%
copy = os.path.join(WORK, "copy")
run("annotated-copy-data", f"{copy}/raw", "--train", "10000")
run("fairseq-preprocess", "--source-lang", "src", "--target-lang", "tgt",
    "--trainpref", f"{copy}/raw/train", "--validpref", f"{copy}/raw/valid",
    "--testpref", f"{copy}/raw/test", "--destdir", f"{copy}/bin", "--joined-dictionary")
log = run("fairseq-train", f"{copy}/bin", "--user-dir", os.path.dirname(fairseq_plugin.__file__),
          "--arch", "annotated_transformer_tiny", "--share-all-embeddings",
          "--criterion", "annotated_label_smoothing", "--label-smoothing", "0.1",
          "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--adam-eps", "1e-9",
          "--lr-scheduler", "noam", "--warmup-updates", "200", "--max-tokens", "4096",
          "--max-epoch", "10", "--seed", "1", "--save-dir", f"{copy}/checkpoints",
          "--no-epoch-checkpoints", "--cpu", "--log-format", "simple")
print("\n".join(line[line.index("epoch"):] for line in log.splitlines() if "valid on" in line))

# %% [markdown]
# Greedy decoding, as in the notebook, and beam search: fairseq's `SequenceGenerator` over the
# decoder's incremental cache.

# %%
for beam in (1, 5):
    out = run("fairseq-generate", f"{copy}/bin", "--user-dir",
              os.path.dirname(fairseq_plugin.__file__), "--path",
              f"{copy}/checkpoints/checkpoint_best.pt", "--beam", beam, "--cpu",
              "--required-batch-size-multiple", "1")
    hyps = {line.split("\t")[0][2:]: line.split("\t")[2] for line in out.splitlines()
            if line.startswith("H-")}
    refs = {line.split("\t")[0][2:]: line.split("\t")[1] for line in out.splitlines()
            if line.startswith("T-")}
    exact = sum(hyps[i] == refs[i] for i in refs) / len(refs)
    print(f"beam {beam}: {exact:.1%} of {len(refs)} test sequences copied exactly; e.g.")
    print("  source", refs["0"], "\n  output", hyps["0"])

# %% [markdown]
# ## A real example: German to English
#
# The bundled Tatoeba sample (60,000 sentence pairs, CC BY 2.0): `annotated-prepare` tokenises
# with fairseq's Moses tokenizer, learns joint BPE (subword-nmt) and binarises; fairseq-train
# trains a small model; `annotated-evaluate-bleu` decodes the test set with beam 5 and scores
# it with sacreBLEU. One epoch here (a few minutes: the translations are still poor);
# `WALKTHROUGH_FULL=1` trains five.

# %%
tatoeba = os.path.join(WORK, "tatoeba")
raw = os.path.join(REPO, "examples", "tatoeba", "data")
print(run("annotated-prepare", "-s", "de", "-t", "en", "--raw-dir", raw, "--dest",
          f"{tatoeba}/bin", "--bpe-merges", "6000", "--force"))

# %%
log = run("fairseq-train", f"{tatoeba}/bin", "--user-dir", os.path.dirname(fairseq_plugin.__file__),
          "--arch", "annotated_transformer", "--encoder-layers", "3", "--decoder-layers", "3",
          "--encoder-embed-dim", "128", "--encoder-ffn-embed-dim", "512",
          "--encoder-attention-heads", "4", "--decoder-attention-heads", "4",
          "--share-all-embeddings", "--criterion", "annotated_label_smoothing",
          "--label-smoothing", "0.1", "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)",
          "--adam-eps", "1e-9", "--lr-scheduler", "noam", "--warmup-updates", 300 if FULL else 150,
          "--max-tokens", "4096", "--max-epoch", 5 if FULL else 1, "--seed", "1",
          "--save-dir", f"{tatoeba}/checkpoints", "--no-epoch-checkpoints", "--cpu",
          "--log-format", "simple")
print("\n".join(line[line.index("epoch"):] for line in log.splitlines() if "valid on" in line))

# %%
print(run("annotated-evaluate-bleu", f"{tatoeba}/bin", f"{tatoeba}/checkpoints/checkpoint_best.pt",
          "--beam", "5", "--examples", "3"))

# %% [markdown]
# ## Attention visualisation
#
# What the trained model attends to, per layer and head: the encoder's self-attention, the
# decoder's self-attention, and the decoder's attention to the source.

# %%
run("annotated-attention-heatmaps", f"{tatoeba}/bin", f"{tatoeba}/checkpoints/checkpoint_best.pt",
    "Tom öffnete das Bier.", "--out-dir", FIGURES, "--layers", "2", "--heads", "0")
for name in sorted(os.listdir(FIGURES)):
    print(name)
