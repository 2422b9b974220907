"""The investigation scripts beside the benchmark (scripts/): each measures what it says, and bad
options are one error line."""

import importlib.util
import os
import re
import sys

import pytest
import torch

from conftest import REPO, exit_code


def load_script(name):
    """scripts/NAME.py as a module."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "scripts", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_profile_steps_lists_each_contestants_operators_and_matrix_products(tmp_path, capsys):
    """scripts/profile_steps.py: torch.profiler's operators of each contestant's steps on the
    same batches; with packing off the padding's matrix products are computed too (the
    benchmark's synthetic data: target lengths drawn apart from the sources', much padding)."""
    from fairseq_plugin.benchmark.data import make_data

    data_bin = make_data(str(tmp_path), 400, 16, 6000)
    load_script("profile_steps").main([
        "--data-bin", data_bin, "--preset", "tiny", "--max-tokens", "1024", "--steps", "1",
        "--contestants", "annotated_transformer,transformer,without-packing"])
    out = capsys.readouterr().out
    gflop = {}
    for name in ("annotated_transformer", "transformer", "annotated_transformer without packing"):
        profiled = re.search(rf"\n{name}, 1 steps profiled: [\d.]+ s of CPU time in [\d.]+ s of "
                             r"wall time, matrix products [\d.]+ s, ([\d,.]+) GFLOP\n(  .*\n)+",
                             out)
        assert profiled, (name, out[-2000:])
        gflop[name] = float(profiled[1].replace(",", ""))
    assert 0 < gflop["annotated_transformer"] < gflop["annotated_transformer without packing"]


def test_attention_new_shapes_times_each_backend_choice_at_shapes_none_other_used(monkeypatch,
                                                                                   capsys):
    """scripts/attention_new_shapes.py: each choice of --fused-attention-backends gets its own
    new shapes (the cost of a new shape is a first call's), and no-cudnn's calls run with
    torch's cuDNN attention switched off."""
    script = load_script("attention_new_shapes")
    sdpa, attend_on = torch.nn.functional.scaled_dot_product_attention, script.attend_on
    calls = []
    cudnn_switch = getattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: None)

    def recorded_attend(backends, q, k, *args):
        calls.append([k.size(2), backends])
        return attend_on(backends, q, k, *args)

    def recorded_sdpa(*args, **kwargs):
        calls[-1].append(cudnn_switch())  # the switch inside the call
        return sdpa(*args, **kwargs)
    monkeypatch.setattr(script, "attend_on", recorded_attend)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recorded_sdpa)
    # on the CPU, the switch as a CUDA device's calls would see it (the CPU's leave it alone)
    fused_backends = script.fused_backends
    monkeypatch.setattr(script, "fused_backends",
                        lambda backends, _: fused_backends(backends, torch.device("cuda")))
    script.main(["--shapes", "3", "--max-tokens", "256"])
    out = capsys.readouterr().out
    tables = re.findall(r"\n(decoding steps|training batches)[^\n]*\n\|[^\n]*\n\|---[^\n]*\n"
                        r"((?:\|[^\n]*\n?)+)", out)
    assert [title for title, _ in tables] == ["decoding steps", "training batches"], out
    for _, rows in tables:
        cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows.splitlines()]
        assert [c[0] for c in cells] == ["torch", "no-cudnn"]
        for backends, operator, first, again, cost, shapes in cells:
            assert operator.startswith("aten::") and shapes == "3"
            assert float(first) > 0 and float(again) > 0
            assert abs(float(first) - float(again) - float(cost)) <= 0.0015
    # the calls: 4 warm-ups (at shapes of their own), then each table's: per choice and shape
    # 1 + 3 timed, then 1 profiled per choice (at its own last shape); keys (rows, h, S, d_k)
    assert len(calls) == 4 + 2 * (2 * 3 * (1 + 3) + 2)
    tables = calls[4:30], calls[30:]
    for table in tables:
        measured, profiled = [tuple(c[:2]) for c in table[:-2]], [tuple(c[:2]) for c in table[-2:]]
        firsts = measured[::4]
        assert [b for _, b in firsts] == ["torch", "no-cudnn", "no-cudnn", "torch", "torch",
                                          "no-cudnn"]
        assert len({S for S, _ in firsts}) == 6  # a new shape each time
        assert all(call == firsts[i // 4] for i, call in enumerate(measured))
        assert profiled == [[f for f in firsts if f[1] == b][-1] for b in ("torch", "no-cudnn")]
    if cudnn_switch() is not None:  # torch >= 2.2: no-cudnn's calls ran with cuDNN off
        assert {(backends, cudnn) for _, backends, cudnn in calls} == {("torch", True),
                                                                       ("no-cudnn", False)}


@pytest.mark.parametrize("args, message", [
    (["--shapes", "0"], "--shapes 0: give a whole number of at least 1"),
    (["--max-tokens", "-3"], "--max-tokens -3: give a whole number of at least 1"),
    (["--device", "cuda"], "--device cuda: torch sees no CUDA GPU here; run with --device cpu"),
])
def test_bad_attention_new_shapes_options_are_one_error_line(args, message, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # also on a GPU machine
    monkeypatch.setattr(sys, "argv", ["attention_new_shapes.py"])  # argparse's program name
    stop = exit_code(load_script("attention_new_shapes").main, args)
    assert stop == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"attention_new_shapes.py: error: {message}"
