"""The notebook's training pieces in reference.py: the label-smoothing loss (finite where the
notebook's is NaN), Batch's shifts and masks, the copy task's data_gen, and run_epoch, which
teaches a small model to copy."""

import math

import torch

from fairseq_plugin import reference


def smoothed_loss(x: float) -> float:
    """The notebook's label-smoothing figure: the gold token 1 given x / d, three others 1 / d
    each, padding (0) given 0, smoothing 0.1."""
    d = x + 3
    predict = torch.tensor([[0.0, x / d, 1 / d, 1 / d, 1 / d]], dtype=torch.float64)
    crit = reference.LabelSmoothing(5, padding_idx=0, smoothing=0.1)
    return crit(predict.log(), torch.tensor([1])).item()


def test_the_label_smoothing_curve_is_finite_and_equals_its_closed_form():
    """KL(q || p) = sum_i q_i (log q_i - log p_i) over the columns where q_i > 0: q is 0.9 on
    the gold token and 0.1 / 3 on the three others; p gives padding 0 (log 0 = -inf), which the
    notebook's KLDivLoss turns into NaN."""
    xs = [1, 2, 5, 10, 27, 50, 100]
    for x in xs:
        d = x + 3
        expected = (0.9 * (math.log(0.9) - math.log(x / d))
                    + 3 * (0.1 / 3) * (math.log(0.1 / 3) - math.log(1 / d)))
        assert math.isfinite(smoothed_loss(x))
        assert math.isclose(smoothed_loss(x), expected, rel_tol=1e-6, abs_tol=1e-7), x  # q is fp32
    # the loss is lowest where p's gold share is 1 - eps: x / (x + 3) = 0.9, x = 27, and it
    # rises again beyond: a smoothed model is punished for being too sure
    losses = [smoothed_loss(x) for x in range(1, 100)]
    assert min(range(len(losses)), key=losses.__getitem__) + 1 == 27
    assert losses[98] > losses[26] + 0.01


def test_a_padding_target_costs_nothing():
    lprobs = torch.randn(3, 6).log_softmax(-1)
    crit = reference.LabelSmoothing(6, padding_idx=1, smoothing=0.1)
    assert math.isclose(crit(lprobs, torch.tensor([2, 1, 1])).item(),
                        crit(lprobs[:1], torch.tensor([2])).item(), rel_tol=1e-6)


def test_batch_shifts_the_target_and_masks_padding_and_the_future():
    pad = 0
    src = torch.tensor([[1, 5, 6, 0], [1, 7, 0, 0]])
    tgt = torch.tensor([[1, 3, 4, 2], [1, 8, 2, 0]])
    batch = reference.Batch(src, tgt, pad)
    assert batch.tgt.tolist() == [[1, 3, 4], [1, 8, 2]]  # what the decoder reads
    assert batch.tgt_y.tolist() == [[3, 4, 2], [8, 2, 0]]  # one step later
    assert batch.ntokens == 5  # the padding target is not counted
    assert batch.src_mask.tolist() == [[[True, True, True, False]], [[True, True, False, False]]]
    assert batch.tgt_mask.shape == (2, 3, 3)
    # position t sees 0 .. t: the lower triangle, here no padding among what is read
    assert batch.tgt_mask[0].tolist() == [[True, False, False], [True, True, False],
                                          [True, True, True]]
    assert batch.tgt_mask.tolist() == batch.tgt_mask[:1].expand(2, 3, 3).tolist()
    no_target = reference.Batch(src, None, pad)
    assert not hasattr(no_target, "tgt_y")


def test_data_gen_draws_copy_pairs_that_start_with_1_and_hold_no_padding():
    g = torch.Generator().manual_seed(0)
    batches = list(reference.data_gen(11, batch_size=4, nbatches=3, generator=g))
    assert len(batches) == 3
    for b in batches:
        assert b.src.shape == (4, 10) and torch.equal(b.src[:, 1:], b.tgt_y)
        assert (b.src[:, 0] == 1).all() and b.src.min() >= 1 and b.src.max() <= 10
        assert b.ntokens == 4 * 9
    assert not torch.equal(batches[0].src, batches[1].src)


def test_run_epoch_teaches_a_small_model_to_copy():
    """The notebook's copy task, smaller: the loss per token falls well below where it starts,
    and an epoch without an optimizer changes nothing."""
    torch.manual_seed(0)
    V = 11
    model = reference.make_model(V, V, N=1, d_model=32, d_ff=64, h=4, dropout=0.0)
    loss_compute = reference.SimpleLossCompute(model.generator,
                                               reference.LabelSmoothing(V, 0, smoothing=0.0))
    optimizer = torch.optim.Adam(model.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: reference.rate(step, 32, factor=1.0, warmup=50))
    g = torch.Generator().manual_seed(1)

    def evaluate():
        model.eval()
        with torch.no_grad():
            return reference.run_epoch(reference.data_gen(V, 20, 2, generator=g), model,
                                       loss_compute)

    before = evaluate()
    weights = [p.detach().clone() for p in model.parameters()]
    assert evaluate() != before  # other batches, same model ...
    assert all(torch.equal(w, p) for w, p in zip(weights, model.parameters()))  # ... unchanged
    for _ in range(8):
        model.train()
        reference.run_epoch(reference.data_gen(V, 20, 20, generator=g), model, loss_compute,
                            optimizer, scheduler)
    after = evaluate()
    assert before > 2.0 and after < before / 4, (before, after)
    src = torch.arange(1, 11)[None]
    out = reference.greedy_decode(model.eval(), src, torch.ones(1, 1, 10, dtype=torch.bool), 10, 1)
    assert (out == src).float().mean() >= 0.8, out
