"""The benchmark's tables: each contestant against fairseq's transformer, as the median of the
per-round ratios."""

import statistics

from .common import THEIRS, THEIRS_NO_CUDNN, arch_of


def ratio_row(label, name, ours, theirs):
    """A table row: the medians, the median of the per-round ratios and the ratios."""
    ratios = [a / b for a, b in zip(ours, theirs)]
    return (f"| {label} | {name} | {statistics.median(ours):.0f} | {statistics.median(theirs):.0f}"
            f" | {statistics.median(ratios):.2f}x | {' '.join(f'{x:.2f}' for x in ratios)} |")


def step_ratio_line(name, ours, theirs):
    """fairseq's time over ``name``'s for the same steps: in all, and the median per step."""
    return (f"{THEIRS} / {name}: {sum(theirs) / sum(ours):.3f}x in all ({sum(theirs):.3f} s / "
            f"{sum(ours):.3f} s), median of the per-step ratios "
            f"{statistics.median(b / a for a, b in zip(ours, theirs)):.3f}x")


# the table's rows: (the figure's key, its label)
ROWS = [("train_wps", "training, target words/s"),
        ("later_wps", "training after the first epoch, target words/s"),
        ("gen_tps", "generation beam 5, tokens/s"),
        ("train_mb", "training peak memory, MB"),
        ("gen_mb", "generation peak memory, MB")]


def print_ratio_table(results, ct2, complete, flops):
    """Each contestant against fairseq's transformer: the ratio of each round's runs, then their
    median (the machine's speed drifts between rounds more than between the runs of a round);
    then each one's model FLOPs utilisation (mfu.py), the median of its rounds. ``results``:
    {name: {key of ROWS: [one figure per round]}}; ``ct2``: CTranslate2's gen_tps and gen_mb
    (empty lists where not measured); ``flops``: main.model_flops's. With THEIRS_NO_CUDNN among
    them, the baseline is the better of fairseq's two runs in each round (better_of)."""
    theirs = results[THEIRS]
    if THEIRS_NO_CUDNN in results:
        theirs = better_of(theirs, results[THEIRS_NO_CUDNN])
        print(f"\n(the transformer column: in each round the better of {THEIRS}'s two runs, "
              "with and without cuDNN attention: the faster, and the smaller peak)")
    print(f"\n| medians of {complete} rounds | model | the model | transformer | "
          "median of the per-round ratios | per-round ratios |")
    print("|---|---|---|---|---|---|")
    later_in_every_run = all(None not in res["later_wps"] for res in results.values())
    for key, label in ROWS:
        if (key == "later_wps" and not later_in_every_run) or not theirs[key]:
            continue  # (said under the table; or not measured: --skip-generation)
        for name in results:
            if name != THEIRS:
                print(ratio_row(label, name, results[name][key], theirs[key]))
    if ct2["gen_tps"]:
        print(ratio_row("generation beam 5, tokens/s", "annotated_transformer exported to "
                        "CTranslate2", ct2["gen_tps"], theirs["gen_tps"]))
    if not later_in_every_run:
        print("\n(no row for training after the first epoch: not every training command logged "
              "an interval after its first epoch; raise --train-updates for it)")
    if flops["peak"]:
        shares = [f"{name} " + utilisation(figures, flops[arch_of(name)], flops["peak"],
                                           later_in_every_run)
                  for name, figures in results.items()]
        print("\nmodel FLOPs utilisation in training, medians of the rounds: "
              + "; ".join(shares))


def utilisation(figures, flops_per_token, peak, later) -> str:
    """'X %' of the peak over all logged intervals, and ' (Y % after the first epoch)'."""
    def share(key):
        return statistics.median(flops_per_token * words / peak for words in figures[key])
    return f"{share('train_wps'):.2%}" + (f" ({share('later_wps'):.2%} after the first epoch)"
                                          if later else "")


def better_of(a, b):
    """Round by round, the better of two runs' figures (ROWS' keys): the higher speed, the lower
    memory (None where either run has none)."""
    def better(key, x, y):
        if x is None or y is None:
            return None
        return min(x, y) if key.endswith("_mb") else max(x, y)
    return {key: [better(key, x, y) for x, y in zip(a[key], b[key])] for key in a}
