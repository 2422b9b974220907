"""The device-dependent paths on a CUDA GPU (``make test-gpu``; skipped without CUDA).

On CUDA the model takes branches the CPU suite does not run: the GPU's fused attention kernels
(in decoding steps, and with dropout in training), ``F.dropout`` instead of the CPU mask,
half-precision kernels. These tests run them for real, and the reverse task end to end in mixed
precision.
"""

import contextlib
import os

import pytest
import torch
import torch.nn.functional as F
from fairseq.sequence_generator import SequenceGenerator

from conftest import (REPO, REVERSE_SEED, BackgroundCli, build_tiny_model, cli, make_dictionary,
                      padded_batch, random_tokens, reverse_data_bin, sharpen)
from fairseq_plugin.benchmark import child, memory
from fairseq_plugin.cli import reverse_task
from fairseq_plugin.modules import dropout
from fairseq_plugin.modules.attention import (EXPLICIT, FUSED, NO_CUDNN, TORCH_CHOICE,
                                              MultiHeadedAttention)
from fairseq_plugin.testing.recomputing import without_cache
from fairseq_plugin.torch_release import TORCH_RELEASE
from test_distributed import (check_equal_to_one_rank_with_update_freq_2, ddp_data_bin, free_port,
                              torchrun_node, train_args, wait_all)

# ANNOTATED_TEST_DEVICE=cpu runs the same tests on the CPU (to check the tests themselves)
DEVICE = os.environ.get("ANNOTATED_TEST_DEVICE", "cuda")
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(
    DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU")]

HALF_TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 1e-1}

try:  # torch >= 2.3: one of scaled_dot_product_attention's GPU backends chosen by hand
    from torch.nn.attention import SDPBackend, sdpa_kernel
    SDPA_BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION,
                     "memory-efficient": SDPBackend.EFFICIENT_ATTENTION,
                     "math": SDPBackend.MATH}
except (ImportError, AttributeError):  # (torch 2.2 has no cuDNN backend)
    SDPA_BACKENDS = {}


def only_backend(name):
    """torch's own choice ("default"), or only the named backend of the fused kernel."""
    return contextlib.nullcontext() if name == "default" else sdpa_kernel([SDPA_BACKENDS[name]])


def torch_has_kernel(backend, dtype):
    """Whether torch's fused attention runs on ``backend`` for ``dtype`` here, asked of torch
    directly at the test's shapes (not through the model, whose own refusal must fail a test,
    not skip it)."""
    q = torch.randn(3, 4, 9, 16, device=DEVICE, dtype=dtype)
    mask = torch.ones(3, 1, 9, 9, dtype=torch.bool, device=DEVICE)
    try:
        with only_backend(backend):
            F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    except RuntimeError as e:
        if not any(m in str(e) for m in ("No available kernel", "No viable backend")):
            raise
        return False
    return True


@pytest.mark.parametrize("backend", ["default", *SDPA_BACKENDS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_fused_and_written_out_attention_agree_on_cuda(dtype, causal, backend):
    """"default": the model's default backends (no-cudnn); a named backend: that one alone, with
    the model on torch's choice (no-cudnn would leave cuDNN's backend nothing to run)."""
    if not torch_has_kernel(backend, dtype):
        pytest.skip(f"torch has no {backend} kernel for {dtype} here")
    attn = MultiHeadedAttention(4, 64, self_attention=True, causal=causal).to(DEVICE).to(dtype)
    attn.eval()
    if backend != "default":
        attn.backends = TORCH_CHOICE
    x = torch.randn(3, 9, 64, device=DEVICE, dtype=dtype)
    pad = torch.zeros(3, 9, dtype=torch.bool, device=DEVICE)
    pad[1, 6:] = True
    pad[2, :] = True  # a fully padded row: zeros, not NaN
    mask = ~pad[:, None, None, :]
    outs = {}
    for kernel in (FUSED, EXPLICIT):
        attn.force_kernel(kernel)
        with only_backend(backend):
            outs[kernel] = attn(x, mask=mask)[0].float()
    assert torch.isfinite(outs[FUSED]).all()
    assert (outs[FUSED] - outs[EXPLICIT]).abs().max() <= HALF_TOLERANCE[dtype]
    # the fully padded row attends to nothing: zeros, so W^O's bias alone, exactly
    bias = attn.out_proj.bias.float().expand(9, 64)
    assert torch.equal(outs[FUSED][2], bias) and torch.equal(outs[EXPLICIT][2], bias)


# incremental decoding against a full pass: about three times the largest difference measured
# (an H200, torch 2.11: fp32 8.3e-07, fp16 0; the CPU, torch 2.13: 9.5e-07 and 2.9e-03)
INCREMENTAL_TOLERANCE = {torch.float32: 3e-6, torch.float16: 1e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_incremental_decoding_equals_a_full_pass_on_cuda(dtype):
    d = make_dictionary()
    model = build_tiny_model(d).to(DEVICE).to(dtype)
    src = random_tokens(d, 4, 7).to(DEVICE)
    src[1, :3] = d.pad()
    tgt = torch.cat([torch.full((4, 1), d.eos()), random_tokens(d, 4, 8)], 1).to(DEVICE)
    with torch.no_grad():
        encoder_out = model.encoder(src, src.ne(d.pad()).sum(1))
        full = model.decoder(tgt, encoder_out=encoder_out)[0]
        state, steps = {}, []
        for t in range(1, tgt.size(1) + 1):
            steps.append(model.decoder(tgt[:, :t], encoder_out=encoder_out,
                                       incremental_state=state)[0])
    diff = (torch.cat(steps, 1) - full).abs().max()
    print(f"incremental vs full pass, {DEVICE} {dtype}: max |diff| {float(diff):.2e}")  # -rP
    assert diff <= INCREMENTAL_TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_layers_give_the_eager_loss_and_gradients_on_cuda(dtype):
    """--compile-layers where it is meant to run: inductor's GPU kernels, a padded training
    batch, dropout 0 (no random draws). fp32: the eager model's loss and gradients within 1e-5
    (relative; the gradients as one vector). bf16: the fused kernels round elsewhere than eager
    bf16, so both are held against the fp32 model: the compiled one's loss and gradients no
    farther from it than the eager one's (x 1.5). The differences are printed (-rP)."""
    from test_compiled import SRC_LENGTHS, TGT_LENGTHS, loss_and_gradients

    torch._dynamo.reset()
    d = make_dictionary(40)
    reference = build_tiny_model(d, dropout=0.0).to(DEVICE).train()  # fp32, eager
    src, _, prev, tgt = (t.to(DEVICE) for t in padded_batch(d, SRC_LENGTHS, TGT_LENGTHS))
    expected_loss, expected = loss_and_gradients(reference, src, prev, tgt, d.pad())

    def distance(model):
        """(relative loss difference, relative L2 distance of all the gradients together) from
        the fp32 eager model's."""
        model.load_state_dict(reference.state_dict())
        model.to(DEVICE).to(dtype).train()
        loss, grads = loss_and_gradients(model, src, prev, tgt, d.pad())
        assert grads.keys() == expected.keys() and len(grads) == len(list(model.parameters()))
        diff = torch.cat([(grads[n].float() - g).flatten() for n, g in expected.items()])
        whole = torch.cat([g.flatten() for g in expected.values()])
        return (float(abs(loss - expected_loss) / abs(expected_loss)),
                float(diff.norm() / whole.norm()))

    eager = distance(build_tiny_model(d, dropout=0.0))
    compiled = distance(build_tiny_model(d, dropout=0.0, compile_layers=True))
    print(f"from fp32 eager, {DEVICE} {dtype}: eager loss {eager[0]:.2e}, gradients "
          f"{eager[1]:.2e}; compiled loss {compiled[0]:.2e}, gradients {compiled[1]:.2e}")  # -rP
    if dtype == torch.float32:
        assert compiled[0] <= 1e-5 and compiled[1] <= 1e-5
    else:
        assert compiled[0] <= 1.5 * eager[0] + 1e-3 and compiled[1] <= 1.5 * eager[1]


def test_beam_search_is_the_same_with_and_without_the_cache_on_cuda():
    d = make_dictionary(40)
    model = sharpen(build_tiny_model(d)).to(DEVICE)
    src = random_tokens(d, 5, 8).to(DEVICE)
    src[:, -1] = d.eos()
    sample = {"net_input": {"src_tokens": src, "src_lengths": torch.full((5,), 8).to(DEVICE)}}

    def generate(m):
        with torch.no_grad():
            return SequenceGenerator([m], d, beam_size=4, max_len_b=12).generate([m], sample)

    for a, b in zip(generate(model), generate(without_cache(model))):
        assert [h["tokens"].tolist() for h in a] == [h["tokens"].tolist() for h in b]


def fused_attention_operators(run):
    """The set of torch's fused-attention operators that ``run()`` calls (torch.profiler's names,
    e.g. aten::_scaled_dot_product_cudnn_attention), and what ``run()`` returns."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        result = run()
    names = {e.key for e in prof.key_averages()}
    return {n for n in names if n.startswith("aten::_scaled_dot_product_")}, result


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_no_cudnn_keeps_beam_search_and_training_off_cudnn_with_the_same_results_on_cuda(dtype):
    """--fused-attention-backends no-cudnn: no cuDNN attention operator runs, in beam search
    (every attention fused) nor in a training step, and the translations and the loss are
    torch's choice's; the operators each choice ran are printed (-rP)."""
    d = make_dictionary(40)
    torch.manual_seed(0)
    model = sharpen(build_tiny_model(d, dropout=0.0)).to(DEVICE).to(dtype)  # no random draws
    model.decoder.need_attn = False  # no weights asked for: the fused kernel everywhere
    src = random_tokens(d, 5, 8).to(DEVICE)
    src[:, -1] = d.eos()
    lengths = torch.full((5,), 8).to(DEVICE)
    sample = {"net_input": {"src_tokens": src, "src_lengths": lengths}}
    tgt = random_tokens(d, 5, 6).to(DEVICE)
    operators, translations, losses = {}, {}, {}

    def beam_then_training_step():
        with torch.no_grad():
            hypos = SequenceGenerator([model], d, beam_size=4, max_len_b=12).generate([model],
                                                                                        sample)
        model.train()
        loss = model(src, lengths, tgt)[0].float().pow(2).mean()
        loss.backward()
        model.eval()
        return [h[0]["tokens"].tolist() for h in hypos], loss.item()

    for backends in (TORCH_CHOICE, NO_CUDNN):
        for m in model.modules():
            if isinstance(m, MultiHeadedAttention):
                m.backends = backends
        operators[backends], (translations[backends], losses[backends]) = \
            fused_attention_operators(beam_then_training_step)
    print(f"fused attention operators, {DEVICE} {dtype}: {operators}; losses {losses}")  # -rP
    assert operators[NO_CUDNN] and not any("cudnn" in op for op in operators[NO_CUDNN])
    assert translations[NO_CUDNN] == translations[TORCH_CHOICE]
    assert abs(losses[NO_CUDNN] / losses[TORCH_CHOICE] - 1) <= HALF_TOLERANCE[dtype]


@pytest.mark.skipif(DEVICE != "cuda", reason="torch.cuda's sync debug mode needs a CUDA GPU")
def test_a_training_step_on_cuda_waits_for_the_device_once_per_stack():
    """What test_model's read counting shows on the CPU, seen by torch.cuda's sync debug mode:
    each stack's forward waits for the GPU once (its one read of the batch's padding), packing's
    index (nonzero_static, given its size) and the backward not at all."""
    import warnings

    d = make_dictionary()
    model = build_tiny_model(d, dropout=0.1).to(DEVICE).train()
    src, tgt = random_tokens(d, 4, 7), random_tokens(d, 4, 6)
    src[1, :4], tgt[3, 2:] = d.pad(), d.pad()  # both stacks pack their rows
    src, tgt = src.to(DEVICE), tgt.to(DEVICE)
    torch.cuda.synchronize()
    waits = []
    for part in ("encoder", "decoder", "backward"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                if part == "encoder":
                    encoder_out = model.encoder(src)
                elif part == "decoder":
                    logits = model.decoder(tgt, encoder_out)[0]
                else:
                    logits.float().logsumexp(-1).sum().backward()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        waits.append(sum("synchroniz" in str(w.message) for w in caught))
    expected_packing_waits = 0 if TORCH_RELEASE >= (2, 6) else 1  # nonzero_static on CUDA: 2.6
    assert waits == [1 + expected_packing_waits, 1 + expected_packing_waits, 0]


def test_training_on_cuda_uses_torch_dropout_and_the_fused_kernel(monkeypatch):
    calls = {"cpu mask": 0, "torch dropout": 0, "fused with dropout": 0}

    def counted(name, function, counts=lambda *args, **kwargs: True):
        def wrapper(*args, **kwargs):
            calls[name] += counts(*args, **kwargs)
            return function(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(dropout._CpuDropout, "apply",
                        counted("cpu mask", dropout._CpuDropout.apply))
    monkeypatch.setattr(F, "dropout", counted(
        "torch dropout", F.dropout, lambda x, p=0.5, *args, **kwargs: p > 0))
    monkeypatch.setattr(F, "scaled_dot_product_attention", counted(
        "fused with dropout", F.scaled_dot_product_attention,
        lambda *args, dropout_p=0.0, **kwargs: dropout_p > 0))
    d = make_dictionary()
    model = build_tiny_model(d, dropout=0.3, attention_dropout=0.1).to(DEVICE).train()
    src, tgt = random_tokens(d, 4, 7).to(DEVICE), random_tokens(d, 4, 6).to(DEVICE)
    logits = model(src, torch.full((4,), 7).to(DEVICE), tgt)[0]
    logits.float().pow(2).mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    # every attention (2 + 2 * 2 in the tiny model) fused, with its dropout; the other dropouts
    # (2 embeddings + 2 * 2 + 2 * 3 sub-layers) torch's on CUDA, the cheaper mask of
    # modules/dropout.py on the CPU
    assert calls["fused with dropout"] == 6
    on_cpu = DEVICE == "cpu"
    assert (calls["cpu mask"], calls["torch dropout"]) == ((12, 0) if on_cpu else (0, 12))


@pytest.mark.skipif(DEVICE != "cuda", reason="torch.cuda's allocator needs a CUDA GPU")
def test_the_cpus_storage_count_of_a_training_step_agrees_with_torch_cudas_allocator(monkeypatch):
    """memory.StoragePeakCounter counts a training step's peak on the CPU (benchmark --steps-in-process) by
    tensor storage; on a GPU its count of a step agrees with torch.cuda's allocator's, within
    what the allocator adds (rounding to 512-byte blocks, kernels' scratch memory)."""
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", torch.cuda.reset_peak_memory_stats)
    d = make_dictionary()
    model = build_tiny_model(d, dropout=0.1).to(DEVICE).train()
    optimizer = torch.optim.Adam(model.parameters())
    src, tgt = random_tokens(d, 64, 32).to(DEVICE), random_tokens(d, 64, 32).to(DEVICE)

    def step():
        optimizer.zero_grad(set_to_none=True)
        logits = model(src, torch.full((64,), 32, device=DEVICE), tgt)[0]
        F.cross_entropy(logits.float().flatten(0, 1), tgt.flatten()).backward()
        optimizer.step()

    step()  # Adam's state and the kernels' set-up before the counts
    counted = memory.StoragePeakCounter().peak_of(step)
    allocated = child.PeakCounter().peak_of(step)
    assert allocated > 2 ** 20
    assert 0.9 * allocated <= counted <= allocated, (counted, allocated)


@pytest.fixture(scope="module")
def ddp_bin(tmp_path_factory):
    return ddp_data_bin(tmp_path_factory)


# fairseq wraps the model for data parallelism only when the world is larger than one rank, so
# its wrappers run here with two ranks on the one GPU: torchrun --nproc-per-node 2 and fairseq's
# own GPU launch (gloo: NCCL wants a GPU per rank)
@pytest.mark.parametrize("ddp_backend", ["legacy_ddp", "c10d"])
def test_two_ranks_on_one_gpu_equal_one_rank_with_update_freq_2(ddp_bin, tmp_path, ddp_backend):
    if DEVICE == "cpu":
        pytest.skip("two ranks on one GPU; on CPUs test_distributed.py runs torchrun and srun")
    save, log = tmp_path / "ddp", tmp_path / "torchrun.log"
    args = [*train_args(ddp_bin, save), "--distributed-world-size", "2",
            "--distributed-backend", "gloo", "--ddp-backend", ddp_backend]
    rank0, = wait_all([torchrun_node(0, 1, 2, free_port(), args, log)], [log])
    check_equal_to_one_rank_with_update_freq_2(ddp_bin, tmp_path, rank0, save, device_flags=())


@pytest.fixture(scope="module")
def reverse_bin(tmp_path_factory):
    return reverse_data_bin(tmp_path_factory.mktemp("reverse-gpu"))


# bf16 goes through fairseq-hydra-train: fairseq 0.12's command-line --bf16 also switches on --tpu
# (fairseq-train then looks for a TPU), its trainer itself casts the model to bf16 on a GPU
PRECISIONS = {"--fp16": ["--fp16"], "--amp": ["--amp"], "bf16 (fairseq-hydra-train)": None}
MIXED_PRECISION_ON_CPU = ("the GPU's mixed precision: fairseq's --fp16 and --amp need CUDA (on "
                          "the CPU: 'Torch not compiled with CUDA enabled')")


def start_training_on_cuda(data_bin, work, precision):
    """The reverse task's 30 epochs on the GPU in ``precision`` (a key of PRECISIONS), started
    in the background: its checkpoints under work/checkpoints."""
    save = work / "checkpoints"
    if PRECISIONS[precision] is None:
        return BackgroundCli(
            work / "train.log", "fairseq-hydra-train",
            "--config-dir", os.path.join(REPO, "examples", "configs"), "--config-name", "reverse",
            f"task.data={data_bin}", f"checkpoint.save_dir={save}",
            f"hydra.run.dir={work}/hydra", "common.cpu=false", "common.bf16=true",
            f"common.seed={REVERSE_SEED}", "optimization.max_epoch=30", cwd=work)
    command = reverse_task.train_command(str(data_bin), str(save), 30, seed=REVERSE_SEED)
    return BackgroundCli(work / "train.log", *[c for c in command if c != "--cpu"],
                         *PRECISIONS[precision])


@pytest.fixture(scope="module")
def mixed_precision_trainings(reverse_bin, tmp_path_factory):
    """The three trainings side by side, started when the first of their tests begins (each
    about 100 s on an H200, mostly the host's work; all three, also where -k selects fewer
    tests, and stopped after the module): {precision: (work dir, BackgroundCli)}."""
    trainings = {}
    for i, precision in enumerate(PRECISIONS):
        work = tmp_path_factory.mktemp(f"mixed-precision-{i}")
        trainings[precision] = work, start_training_on_cuda(reverse_bin, work, precision)
    yield trainings
    for _, training in trainings.values():
        training.stop()


@pytest.mark.skipif(DEVICE == "cpu", reason=MIXED_PRECISION_ON_CPU)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_reverse_task_in_mixed_precision_reaches_the_cpu_bar_and_translates_alike_on_cpu(
        reverse_bin, mixed_precision_trainings, precision):
    work, training = mixed_precision_trainings[precision]
    log = training.output()
    if PRECISIONS[precision] is None:  # the configuration fairseq's trainer was given
        assert "'bf16': True" in log and "'tpu': False" in log and "'cpu': False" in log
    checkpoint = str(work / "checkpoints" / "checkpoint_best.pt")  # as the CPU suite's
    outputs = {}
    for device in ("cuda", "cpu"):
        command = reverse_task.generate_command(str(reverse_bin), checkpoint, beam=5)
        if device == "cuda":
            command = [c for c in command if c != "--cpu"]
        path = work / f"generate-{device}.txt"
        path.write_text(cli(*command).stdout)
        outputs[device] = reverse_task.read_generate_output(str(path))
    assert reverse_task.exact_match(outputs["cuda"]) >= 0.95
    assert sorted(outputs["cuda"]) == sorted(outputs["cpu"])
    differ = sorted(i for i in outputs["cpu"] if outputs["cuda"].get(i) != outputs["cpu"][i])
    assert not differ, (f"{len(differ)} of {len(outputs['cpu'])} translations differ between "
                        f"the GPU and the CPU, e.g. "
                        f"{[(i, outputs['cuda'].get(i), outputs['cpu'][i]) for i in differ[:3]]}")
