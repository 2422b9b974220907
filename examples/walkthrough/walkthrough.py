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
# (`figures/`); the charts a reader explores (positional encodings, the Noam schedule, pre-LN
# against post-LN, the trained model's attention) are Altair charts: hover for the numbers. It
# runs top to bottom in a few minutes on 2 CPU cores; set `WALKTHROUGH_FULL=1` for longer
# training and better translations.
#
# Open it with `make walkthrough`, run it with `jupytext --execute`, or read it as a web page with
# every output in place: `make page`.

# %%
import inspect
import logging
import os
import shutil
import subprocess
import sys
import warnings
from argparse import Namespace
from types import SimpleNamespace

logging.getLogger("fairseq").setLevel(logging.WARNING)  # its import notes on optional packages
logging.getLogger("matplotlib").setLevel(logging.WARNING)  # its font search
warnings.filterwarnings("ignore", message=".*pin_memory")  # fairseq's loader asks for it on CPUs
import matplotlib.pyplot as plt  # noqa: E402  (Jupyter shows each figure below its cell)
import numpy as np  # noqa: E402
import torch  # noqa: E402
from fairseq.data import Dictionary  # noqa: E402
from fairseq.models import MODEL_REGISTRY  # noqa: E402

import charts  # noqa: E402  (this folder's charts.py: Altair charts)
import fairseq_plugin  # noqa: E402  (registers the model, criterion and schedule)
from fairseq_plugin import reference  # noqa: E402
from fairseq_plugin.reference_weights import load_plain_weights, plain_attention, plain_model  # noqa: E402,E501

FULL = os.environ.get("WALKTHROUGH_FULL") == "1"
SMOKE_TEST = os.environ.get("WALKTHROUGH_SMOKE_TEST") == "1"  # the test's: 60 Tatoeba updates


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


def save(fig, name, shown=True):
    """Write a figure, after checking that it draws something: every line and image holds
    data, all of it finite (a NaN draws nothing, and a blank figure would pass unseen).
    ``shown=False``: written for the docs only, where an interactive chart shows the same."""
    for ax in fig.axes:
        for artist in [*ax.get_lines(), *ax.get_images()]:
            data = artist.get_ydata() if hasattr(artist, "get_ydata") else artist.get_array()
            data = np.asarray(data, dtype=float)
            assert data.size and np.isfinite(data).all(), f"{name}: empty or not finite data"
    path = os.path.join(FIGURES, name)
    fig.savefig(path, dpi=80, bbox_inches="tight")
    print("wrote", os.path.relpath(path, HERE))
    if shown:
        plt.show()  # here, before what the cell shows next
    else:
        plt.close(fig)


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
# concatenates the heads and projects with W^O. First the notebook's plain pieces:
# `attention` is the formula above, and `MultiHeadedAttention.forward` its three numbered steps.

# %%
show_source(reference.attention, reference.MultiHeadedAttention.forward)

# %% [markdown]
# The plugin's class (`fairseq_plugin/modules/attention.py`) takes the same three steps, faster:
# it stores W^Q, W^K, W^V side by side (one matrix product) and runs torch's fused kernel, which
# never forms the weights unless they are asked for. Its extra arguments are what fairseq needs:
#
# | argument | what it is for |
# |---|---|
# | `query`, `memory` | the notebook's `query`, and `key` = `value` = the encoder's output in the decoder's source attention (`None`: self-attention) |
# | `mask` | the notebook's mask with a head axis: (B, 1, T, S), True where a query may look |
# | `incremental_state` | fairseq's cache while beam search decodes one token at a time: the keys and values of earlier steps are kept, not recomputed (`modules/cache.py`) |
# | `need_weights` | return the weights (B, h, T, S), for the heat-maps at the end; otherwise the fused kernel |
# | `packing` | in training, the projections run on real tokens only, not on padding (`modules/packing.py`) |

# %%
from fairseq_plugin.modules.attention import MultiHeadedAttention  # noqa: E402

show_source(MultiHeadedAttention.forward)
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
save(fig, "positional_encoding.png", shown=False)
charts.show(charts.curves(
    [{"position": p, "value": pe[p, dim].item(), "dimension": f"dimension {dim}"}
     for dim in (4, 5, 6, 7) for p in range(100)], "position", "value", "dimension",
    "positional encoding (d_model 20)", "position", "value"))

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
NOAM_SETTINGS = ((512, 1, 4000), (512, 1, 8000), (256, 1, 4000))
fig, ax = plt.subplots(figsize=(6, 3))
for d_model, factor, warmup in NOAM_SETTINGS:
    ax.plot([reference.rate(s, d_model, factor, warmup) for s in range(1, 20000, 50)],
            label=f"d_model {d_model}, warmup {warmup}")
ax.set_xlabel("step (x50)")
ax.legend()
save(fig, "noam.png", shown=False)
charts.show(charts.curves(
    [{"step": s, "rate": reference.rate(s, d_model, factor, warmup),
      "setting": f"d_model {d_model}, warmup {warmup}"}
     for d_model, factor, warmup in NOAM_SETTINGS for s in range(1, 20000, 100)],
    "step", "rate", "setting", "the Noam schedule", "step", "learning rate"))

# %% [markdown]
# ## A first example, the notebook's way
#
# The notebook's first task: given random symbols from a small vocabulary, output the same
# symbols. Its training loop is in `reference.py` too: `data_gen` makes batches of the copy
# task, `Batch` shifts each target by one for teacher forcing (the decoder reads `tgt` and is
# taught to predict `tgt_y`) and builds the masks, `SimpleLossCompute` applies the generator and
# the criterion, and `run_epoch` takes a step per batch.

# %%
show_source(reference.Batch, reference.data_gen, reference.SimpleLossCompute, reference.run_epoch)

# %% [markdown]
# The notebook's recipe: `make_model(11, 11, N=2)`, no smoothing, Adam with β = (0.9, 0.98) and
# ε = 1e-9, base rate 0.5 scaled by `rate` (warm-up 400) through `LambdaLR`, 20 batches of 80 an
# epoch, then 5 held-out batches without an optimizer. Here at a quarter of the notebook's
# width (d_model 128), which learns the task as well in a fraction of the time on a CPU;
# `WALKTHROUGH_FULL=1` trains the notebook's d_model 512.

# %%
V, WIDTH = 11, 512 if FULL else 128
torch.manual_seed(0)
model = reference.make_model(V, V, N=2, d_model=WIDTH, d_ff=4 * WIDTH)
criterion = reference.LabelSmoothing(V, padding_idx=0, smoothing=0.0)
loss_compute = reference.SimpleLossCompute(model.generator, criterion)
optimizer = torch.optim.Adam(model.parameters(), lr=0.5, betas=(0.9, 0.98), eps=1e-9)
scheduler = torch.optim.lr_scheduler.LambdaLR(
    optimizer, lr_lambda=lambda step: reference.rate(step, WIDTH, factor=1.0, warmup=400))
notebook_losses = []  # (updates so far, held-out loss per token)
for epoch in range(20 if FULL else 10):
    model.train()
    reference.run_epoch(reference.data_gen(V, 80, 20), model, loss_compute, optimizer, scheduler)
    model.eval()
    with torch.no_grad():
        held_out = reference.run_epoch(reference.data_gen(V, 80, 5), model, loss_compute)
    notebook_losses.append((20 * (epoch + 1), held_out))
    print(f"epoch {epoch + 1}: held-out loss per token {held_out:.3f}")

# %% [markdown]
# Greedy decoding, the notebook's `greedy_decode`: encode once, then run the decoder over the
# whole prefix at every step and append the most probable next symbol.

# %%
show_source(reference.greedy_decode)
src = torch.arange(1, 11)[None]  # [[1, 2, ..., 10]]: 1 is the copy task's start symbol
decoded = reference.greedy_decode(model, src, torch.ones(1, 1, 10, dtype=torch.bool), max_len=10,
                                  start_symbol=1)
print("source ", src[0].tolist(), "\ndecoded", decoded[0].tolist())
copied = int((decoded[:, 1:] == src[:, 1:]).sum())  # after the start symbol, which it is given
print(f"greedy_decode copied {copied} of 9 symbols")

# %% [markdown]
# ## The same task with fairseq
#
# fairseq works from files: `annotated-copy-data` writes the copy task as text (sequences of
# the symbols a to j), and `fairseq-preprocess` turns the text into what training reads:
#
# - `dict.src.txt`, `dict.tgt.txt`: the vocabulary, a symbol and its count per line; fairseq
#   puts `<s>`, `<pad>`, `</s>`, `<unk>` at indices 0 to 3 before them (`--joined-dictionary`:
#   one vocabulary for both sides, which shared embeddings need);
# - `train.src-tgt.src.bin` and `.idx` (and valid, test, and the `tgt` side): every sentence's
#   token indices in one flat binary array, and where each sentence starts in it; training maps
#   them into memory instead of reading them (the notebook tokenises on the fly);
# - `preprocess.log`: the command's settings and counts.

# %%
copy = os.path.join(WORK, "copy")
run("annotated-copy-data", f"{copy}/raw", "--train", "10000")
print(open(f"{copy}/raw/train.src").readline())
run("fairseq-preprocess", "--source-lang", "src", "--target-lang", "tgt",
    "--trainpref", f"{copy}/raw/train", "--validpref", f"{copy}/raw/valid",
    "--testpref", f"{copy}/raw/test", "--destdir", f"{copy}/bin", "--joined-dictionary")
for name in sorted(os.listdir(f"{copy}/bin")):
    print(f"{name:26} {os.path.getsize(os.path.join(copy, 'bin', name)):>8,} bytes")
copy_dict = Dictionary.load(f"{copy}/bin/dict.src.txt")
print("first symbols:", [copy_dict[i] for i in range(8)])

# %% [markdown]
# Each training flag below is one of the notebook's objects:
#
# | fairseq-train | the notebook |
# |---|---|
# | `--arch annotated_transformer_tiny` | `make_model(V, V, N=2, d_model=64, d_ff=256, h=4)` (the presets: `fairseq_plugin/models`) |
# | `--share-all-embeddings` | "Shared Embeddings": one matrix for the source and target embeddings and the generator (needs `--joined-dictionary`); the notebook describes it, its `make_model` does not tie them |
# | `--criterion annotated_label_smoothing --label-smoothing 0.1` | `LabelSmoothing(V, pad, smoothing=0.1)` inside `SimpleLossCompute` |
# | `--optimizer adam --adam-betas "(0.9, 0.98)" --adam-eps 1e-9` | `torch.optim.Adam(params, betas=(0.9, 0.98), eps=1e-9)` |
# | `--lr-scheduler noam --warmup-updates 200` | `LambdaLR(optimizer, lambda step: rate(step, d_model, factor, 200))`; `--noam-factor` is `factor` times the notebook's base `lr` |
# | `--max-tokens 4096` | `data_gen`'s `batch_size=80` sentences (the 2018 notebook's `batch_size_fn`): batches of sentences of similar length, as many as keep (longest sentence, source or target, with `</s>`) × sentences ≤ 4096, the count a multiple of `--required-batch-size-multiple` (8) |
# | `--max-epoch 10` | `for epoch in range(10)` |
# | `--seed 1` | `torch.manual_seed(1)` |
# | `--save-dir`, `--no-epoch-checkpoints` | `torch.save` after each epoch: here `checkpoint_best.pt` (lowest validation loss) and `checkpoint_last.pt` |
# | `--log-interval 10` | the notebook's progress print every few steps |

# %%
def train_copy(save_dir, *more_flags):
    """fairseq-train on the copy task with the flags above; its log."""
    return run("fairseq-train", f"{copy}/bin", "--user-dir",
               os.path.dirname(fairseq_plugin.__file__),
               "--arch", "annotated_transformer_tiny", "--share-all-embeddings",
               "--criterion", "annotated_label_smoothing", "--label-smoothing", "0.1",
               "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--adam-eps", "1e-9",
               "--lr-scheduler", "noam", "--warmup-updates", "200", "--max-tokens", "4096",
               "--max-epoch", "10", "--seed", "1", "--save-dir", save_dir,
               "--no-epoch-checkpoints", "--cpu", "--log-format", "simple", "--log-interval", "10",
               *more_flags)


log = train_copy(f"{copy}/checkpoints")
print("\n".join(line[line.index("epoch"):] for line in log.splitlines()
                if "valid on" in line or "num_updates=10," in line))

# %% [markdown]
# fairseq's loop does `run_epoch`'s work in `fairseq_cli/train.py` and its `Trainer`:
#
# - `for batch in data_iter` is the epoch iterator (`task.get_batch_iterator`): the batches are
#   grouped by length and shuffled anew each epoch;
# - the forward pass and `loss_compute` are `criterion(model, sample)` in `task.train_step`; the
#   criterion returns the summed loss and the batch's target tokens (`ntokens`);
# - `loss.backward()` is in `task.train_step` too; the division by `ntokens` comes after it:
#   the trainer scales the gradients by 1 / ntokens, counted over all GPUs and `--update-freq`
#   batches (by 1 / sentences with `--sentence-avg`);
# - `optimizer.step()` and `zero_grad()` are the trainer's, then `scheduler.step()` is
#   `lr_scheduler.step_update(num_updates)`;
# - the held-out `run_epoch` without an optimizer is `validate` after each epoch (the
#   "valid on" lines), with the model in `eval()` mode and no gradients, then a checkpoint.
#
# Its progress lines (`--log-interval 10`) give the loss every 10 updates, as log base 2 per
# token; the figure converts them to natural logarithms, the notebook's unit. (fairseq's
# `loss` includes the label smoothing; `nll_loss`, drawn here, is the negative log-likelihood
# alone, as the notebook's loss without smoothing is.) With ε = 0.1 fairseq's curve levels off
# near −ln 0.9 ≈ 0.1: label smoothing teaches the model to give the right symbol 0.9, not 1.

# %%
import math  # noqa: E402
import re  # noqa: E402


def nll_curve(log, valid=False):
    """(updates, NLL per token in nats) from fairseq-train's progress lines, or its "valid on"
    lines."""
    pattern = (r"valid on 'valid' subset \| loss [\d.]+ \| nll_loss ([\d.]+) .*?num_updates (\d+)"
               if valid else r"nll_loss=([\d.]+),.*?num_updates=(\d+)")
    points = [(int(m[2]), float(m[1]) * math.log(2)) for m in re.finditer(pattern, log)]
    assert points, "no loss in fairseq-train's log"
    return [u for u, _ in points], [loss for _, loss in points]


fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot(*zip(*notebook_losses), marker="o", label=f"the notebook's loop, d_model {WIDTH}, held out")
ax.plot(*nll_curve(log), label="fairseq-train, annotated_transformer_tiny, training")
ax.plot(*nll_curve(log, valid=True), marker="o", label="fairseq-train, validation")
ax.set_xlabel("update")
ax.set_ylabel("NLL per token (nats)")
ax.set_yscale("log")
ax.set_title("the copy task")
ax.legend(fontsize=8, loc="lower left")
save(fig, "copy_task_loss.png")

# %% [markdown]
# Greedy decoding and beam search: fairseq's `SequenceGenerator` over the decoder's incremental
# cache. `fairseq-generate` prints, for each test sentence i (sorted by length):
#
# - `S-i`: the source; `T-i`: the reference target;
# - `H-i`: the hypothesis and its score: the sum of its `P-i` values divided by its length with
#   `</s>` (to the power `--lenpen`, 1 by default), base 2; the finished hypotheses are ranked by
#   it (during the search the beams are kept by their summed log-probability);
#   `D-i`: the same, detokenised (identical here: no BPE, no tokenizer);
# - `P-i`: the log-probability (base 2) of each token of the hypothesis, `</s>` last.

# %%
generated = {}
for beam in (1, 5):
    out = run("fairseq-generate", f"{copy}/bin", "--user-dir",
              os.path.dirname(fairseq_plugin.__file__), "--path",
              f"{copy}/checkpoints/checkpoint_best.pt", "--beam", beam, "--cpu",
              "--required-batch-size-multiple", "1")
    generated[beam] = {kind: {line.split("\t")[0][2:]: line.split("\t")[-1]
                              for line in out.splitlines() if line.startswith(f"{kind}-")}
                       for kind in "STH"}
    hyps, refs = generated[beam]["H"], generated[beam]["T"]
    exact = sum(hyps[i] == refs[i] for i in refs) / len(refs)
    print(f"beam {beam}: {exact:.1%} of {len(refs)} test sequences copied exactly")
print("\n".join(line for line in out.splitlines() if line.split("\t")[0][2:] == "0"))

# %% [markdown]
# The notebook's `greedy_decode` on the same checkpoint's weights, loaded into the plain model
# (`reference_weights.plain_model_from_checkpoint`), writes what `fairseq-generate --beam 1`
# wrote, test sequence by test sequence.

# %%
from fairseq.data.data_utils import collate_tokens  # noqa: E402

from fairseq_plugin.reference_weights import plain_model_from_checkpoint  # noqa: E402

copy_model = plain_model_from_checkpoint(f"{copy}/checkpoints/checkpoint_best.pt",
                                         {"data": f"{copy}/bin"}).eval()
ids = sorted(generated[1]["S"], key=int)
sources = collate_tokens([copy_dict.encode_line(generated[1]["S"][i], add_if_not_exist=False).long()
                          for i in ids], copy_dict.pad())  # padded on the right, as the notebook's
ys = reference.greedy_decode(copy_model, sources, reference.src_mask_of(sources, copy_dict.pad()),
                             max_len=sources.size(1) + 5, start_symbol=copy_dict.eos())
greedy = []
for row in ys[:, 1:].tolist():  # without the start symbol, up to the first </s>
    greedy.append(copy_dict.string(torch.tensor(row[:row.index(copy_dict.eos())]
                                                if copy_dict.eos() in row else row)))
same = sum(g == generated[1]["H"][i] for g, i in zip(greedy, ids))
print(f"reference.greedy_decode wrote what fairseq-generate --beam 1 wrote for {same} of "
      f"{len(ids)} test sequences")
assert same == len(ids)

# %% [markdown]
# ## Pre-LN or post-LN?
#
# The paper puts layer normalisation after each residual sum, LayerNorm(x + Sublayer(x))
# (post-LN); the notebook's `SublayerConnection` puts it first, x + Sublayer(LayerNorm(x)), and
# ends each stack with one more LayerNorm (pre-LN). Readers of the notebook ask which is right
# (harvardnlp/annotated-transformer issues 1, 13 and 92): both are Transformers. In pre-LN every
# layer adds to an untouched residual stream, so the gradient reaches the lowest layer whole and
# training is stable with little warm-up (Xiong et al., 2020, *On Layer Normalization in the
# Transformer Architecture*); post-LN normalises the stream itself after every sub-layer and
# leans on the learning-rate warm-up to start. This package is pre-LN, as the notebook;
# `--post-norm` gives the paper's. The same copy task, trained both ways with every other flag
# and the seed equal:

# %%
post_log = train_copy(f"{copy}/post-ln", "--post-norm",
                      *(["--max-epoch", "5"] if SMOKE_TEST else []))  # (the test's: 5 epochs)
for name, text in (("pre-LN (the notebook)", log), ("post-LN (the paper, --post-norm)", post_log)):
    losses = nll_curve(text, valid=True)[1]  # (a point each epoch)
    print(f"{name}: validation NLL after {len(losses)} epochs {losses[-1]:.3f} nats per token")
charts.show(charts.curves(
    [{"update": u, "NLL": loss, "run": f"{name}, {part}"}
     for name, text in (("pre-LN", log), ("post-LN", post_log))
     for part, valid in (("training", False), ("validation", True))
     for u, loss in zip(*nll_curve(text, valid=valid))],
    "update", "NLL", "run", "the copy task, pre-LN and post-LN", "update",
    "NLL per token (nats)", log_y=True))

# %% [markdown]
# ## A real example: German to English
#
# The bundled Tatoeba sample (60,000 sentence pairs, CC BY 2.0): `annotated-prepare` tokenises
# with fairseq's Moses tokenizer, learns joint BPE (subword-nmt) and binarises with
# fairseq-preprocess; fairseq-train trains a small model; `annotated-evaluate-bleu` decodes the
# test set with beam 5 and scores it with sacreBLEU. One epoch here (a few minutes: the
# translations are still poor); `WALKTHROUGH_FULL=1` trains five.

# %%
tatoeba = os.path.join(WORK, "tatoeba")
raw = os.path.join(REPO, "examples", "tatoeba", "data")
print(run("annotated-prepare", "-s", "de", "-t", "en", "--raw-dir", raw, "--dest",
          f"{tatoeba}/bin", "--bpe-merges", "6000", "--force"))

# %% [markdown]
# One of fairseq's batches, as `fairseq-train` makes it, beside the notebook's `Batch` of the
# same three sentences. fairseq pads sources on the left (`src_tokens`); it ends each target
# with `</s>` (`target`, the notebook's `tgt_y`) and feeds the decoder the same tokens moved one
# step right behind a `</s>` (`prev_output_tokens`, the notebook's `tgt`). The masks are not in
# the batch: the plugin's encoder and decoder make them from the tokens.

# %%
from fairseq.tasks.translation import TranslationConfig, TranslationTask  # noqa: E402

from fairseq_plugin.reference_weights import right_padded  # noqa: E402

translation = TranslationTask.setup_task(TranslationConfig(  # fairseq-train's defaults
    data=f"{tatoeba}/bin", source_lang="de", target_lang="en", dataset_impl="mmap",
    required_seq_len_multiple=1))
translation.load_dataset("valid")
pairs = translation.dataset("valid")
sample = pairs.collater([pairs[i] for i in (0, 1, 2)])  # (re-ordered: longest source first)
print("validation sentences", sample["id"].tolist())
words = translation.target_dictionary
pad = words.pad()
src_tokens, prev_output_tokens = (sample["net_input"][k] for k in ("src_tokens",
                                                                    "prev_output_tokens"))
for name, tokens in (("src_tokens", src_tokens), ("prev_output_tokens", prev_output_tokens),
                     ("target", sample["target"])):
    print(f"fairseq {name}:\n{tokens}")
print("fairseq ntokens:", sample["ntokens"])
# The notebook's Batch: sources padded on the right; each target with its start symbol first
# (fairseq's </s> serves as both)
batch = reference.Batch(right_padded(src_tokens, pad),
                        torch.cat([prev_output_tokens[:, :1], sample["target"]], dim=1), pad)
print(f"Batch.src:\n{batch.src}\nBatch.src_mask:\n{batch.src_mask.int()}")
print(f"Batch.tgt:\n{batch.tgt}\nBatch.tgt_y:\n{batch.tgt_y}")
print(f"Batch.tgt_mask of the third row:\n{batch.tgt_mask[2].int()}")
print("Batch.ntokens:", batch.ntokens)
print("the targets, in sub-words:", *(words.string(row[row.ne(pad)]) for row in sample["target"]),
      sep="\n  ")
counted = sample["target"].ne(pad)  # the positions whose prediction the loss counts
assert torch.equal(batch.tgt_y, sample["target"]) and batch.ntokens == sample["ntokens"]
assert torch.equal(batch.tgt[counted], prev_output_tokens[counted])

# %% [markdown]
# `tgt_y` is `target`, token for token, and both count the same tokens. `tgt` is
# `prev_output_tokens` wherever a prediction counts; after a shorter sentence's end the
# notebook feeds its `</s>` where fairseq feeds padding, at a position whose prediction is
# padding and not counted.

# %%
log = run("fairseq-train", f"{tatoeba}/bin", "--user-dir", os.path.dirname(fairseq_plugin.__file__),
          "--arch", "annotated_transformer", "--encoder-layers", "3", "--decoder-layers", "3",
          "--encoder-embed-dim", "128", "--encoder-ffn-embed-dim", "512",
          "--encoder-attention-heads", "4", "--decoder-attention-heads", "4",
          "--share-all-embeddings", "--criterion", "annotated_label_smoothing",
          "--label-smoothing", "0.1", "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)",
          "--adam-eps", "1e-9", "--lr-scheduler", "noam", "--warmup-updates", 300 if FULL else 150,
          "--max-tokens", "4096", "--max-epoch", 5 if FULL else 1, "--seed", "1",
          *(["--max-update", "60"] if SMOKE_TEST else []),
          "--save-dir", f"{tatoeba}/checkpoints", "--no-epoch-checkpoints", "--cpu",
          "--log-format", "simple", "--log-interval", "10")
print("\n".join(line[line.index("epoch"):] for line in log.splitlines() if "valid on" in line))
fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot(*nll_curve(log), label="training")
ax.plot(*nll_curve(log, valid=True), marker="o", label="validation")
ax.set_xlabel("update")
ax.set_ylabel("NLL per token (nats)")
ax.set_title("Tatoeba de-en, 3+3 layers, d_model 128")
ax.legend()
save(fig, "tatoeba_loss.png")

# %% [markdown]
# ## Greedy decoding or beam search?
#
# The notebook decodes greedily: at each step the single most probable token. Beam search
# (harvardnlp/annotated-transformer issue 8) keeps the k most probable prefixes instead, and
# ends with the best finished one; fairseq's `SequenceGenerator` does it over the decoder's
# incremental cache. `annotated-evaluate-bleu` decodes the 1,000 test sentences with each and
# scores them: BLEU and chrF from sacreBLEU, on detokenised text against the raw references
# (the notebook's readers ask how, issues 51 and 108). Each score comes with its *signature*,
# sacreBLEU's record of how it was computed (tokenisation `13a`, case, smoothing, version):
# scores are comparable only where the signatures match. (fairseq-generate's own `BLEU4` line
# scores the tokenised sub-words, and reads higher.)

# %%
checkpoint = f"{tatoeba}/checkpoints/checkpoint_best.pt"
for beam in (1, 5):
    print(f"--- {'greedy (beam 1)' if beam == 1 else f'beam {beam}'}")
    print(run("annotated-evaluate-bleu", f"{tatoeba}/bin", checkpoint, "--beam", beam,
              "--examples", 3 if beam == 5 else 0,
              # (the test's 60-update model would write 200 tokens a sentence: 30 at most)
              *(["--max-len-b", "30"] if SMOKE_TEST else [])))

# %% [markdown]
# What the incremental cache saves: at step t the decoder needs the keys and values of the t
# tokens before; the notebook's `greedy_decode` runs the decoder over the whole prefix again at
# every step, while the plugin's attention keeps them in fairseq's `incremental_state`
# (`modules/cache.py`) and computes only the new token's. Measured on this model: seconds to
# decode 20 sentences to a fixed length, cached (the fused attention kernel), cached with the
# attention written out as the notebook writes it, and recomputing the prefix every step (the
# notebook's way, `testing/recomputing.py`); medians of alternated rounds. The cache's gain
# grows with the length: each step costs the same with it, and more with every token without.

# %%
from fairseq_plugin.benchmark.child import Device  # noqa: E402
from fairseq_plugin.benchmark.decoding import print_cache_table  # noqa: E402

print_cache_table(checkpoint, f"{tatoeba}/bin", lengths=(10, 30), device=Device("cpu"),
                  n_sentences=20, repeats=1 if SMOKE_TEST else 3)

# %% [markdown]
# ## Attention visualisation
#
# What the trained model attends to, as the notebook draws it: every head of every layer, for
# the encoder's self-attention, the decoder's self-attention and the decoder's attention to the
# source. Layers and heads are numbered from 1, as in the notebook. Rows are queries, columns
# the keys they attend to; each row sums to 1. `annotated-attention-heatmaps` writes the same
# maps one file each, numbered from 0 as its `--layers` and `--heads` are: layer 3, head 1 here
# is its `decoder_source_layer2_head0.png`.
#
# ### Encoder self-attention

# %%
from fairseq_plugin.cli import heatmaps  # noqa: E402

hub = heatmaps.load_hub(f"{tatoeba}/bin", f"{tatoeba}/checkpoints/checkpoint_best.pt")
said, src_labels, fed_labels, out_labels, maps = heatmaps.attention_maps(hub,
                                                                         "Tom öffnete das Bier.")
print("translation:", said)


def draw_layers_and_heads(kind, rows, cols, title):
    """One map per layer (rows of the grid) and head (its columns)."""
    n_layers = 1 + max(layer for layer, _ in maps[kind])
    n_heads = 1 + max(head for _, head in maps[kind])
    size = (0.3 * len(cols) * n_heads + 2, 0.3 * len(rows) * n_layers + 2)
    fig, axes = plt.subplots(n_layers, n_heads, squeeze=False, figsize=size)
    for (layer, head), weights in maps[kind].items():
        ax = axes[layer][head]
        ax.imshow(np.array(weights), cmap="viridis", vmin=0.0, vmax=1.0)
        ax.set_xticks(range(len(cols)), cols if layer == n_layers - 1 else [], rotation=90,
                      fontsize=7)
        ax.set_yticks(range(len(rows)), rows if head == 0 else [], fontsize=7)
        ax.set_title(f"Layer {layer + 1}, head {head + 1}", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


fig = draw_layers_and_heads("encoder_self", src_labels, src_labels, "encoder self-attention")
save(fig, "encoder_self.png")

# %% [markdown]
# One head at a time: pick the layer and the head, hover a cell for its tokens and weight.

# %%
charts.show(charts.attention(maps["encoder_self"], src_labels, src_labels,
                             "encoder self-attention", "query (source token)",
                             "key (source token)"))

# %% [markdown]
# ### Decoder self-attention
#
# Each row is the decoder predicting a target token (rows are labelled with it) from the
# tokens fed in so far (columns): nothing to the right of the diagonal, `subsequent_mask`.

# %%
fig = draw_layers_and_heads("decoder_self", out_labels, fed_labels, "decoder self-attention")
save(fig, "decoder_self.png")
charts.show(charts.attention(maps["decoder_self"], out_labels, fed_labels,
                             "decoder self-attention", "target token (predicted)",
                             "target token (fed in)"))

# %% [markdown]
# ### Decoder source attention
#
# Where each target token looks in the source: after enough training, some heads come close
# to a word alignment (the figure in docs/walkthrough.md is from five epochs).

# %%
fig = draw_layers_and_heads("decoder_source", out_labels, src_labels, "decoder-source attention")
save(fig, "decoder_source.png")
charts.show(charts.attention(maps["decoder_source"], out_labels, src_labels,
                             "decoder-source attention", "target token", "source token"))

# %% [markdown]
# ## The versions it runs on
#
# The notebook's code stopped running as its libraries moved on (harvardnlp/annotated-transformer
# issues 136, 133 and 46), and its Multi30k download is gone (issue 96). This walkthrough needs
# neither torchtext nor spaCy nor a download: fairseq's data pipeline, the Tatoeba sample bundled
# with this package, and the versions below. The test suite runs it top to bottom on each
# change; the package's own tests run on Python 3.10 with the official fairseq 0.12.2 as well
# (docs/install.md).

# %%
import importlib.metadata  # noqa: E402
import platform  # noqa: E402

print("Python", platform.python_version())
for package in ("torch", "fairseq-fixed", "fairseq", "sacrebleu", "sacremoses", "subword-nmt",
                "altair"):
    try:
        print(package, importlib.metadata.version(package))
    except importlib.metadata.PackageNotFoundError:
        pass
