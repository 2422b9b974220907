"""The cache must change nothing: step-by-step decoding equals one full pass."""

import contextlib
import statistics

import pytest
import torch
from fairseq.sequence_generator import SequenceGenerator
from omegaconf import OmegaConf

from conftest import (CPU_AUTOCAST_DTYPES, PLUGIN_DIR, build_tiny_model, make_dictionary,
                      random_tokens, reverse_data_bin, sharpen)
from fairseq_plugin.modules.attention import EXPLICIT, FUSED, MultiHeadedAttention
from fairseq_plugin.modules.cache import (ReorderPlans, SourceAttentionCache, plan_reorder,
                                          repeats_rows)
from fairseq_plugin.models.encoder import source_mask
from fairseq_plugin.modules import attention as attention_module
from fairseq_plugin.reference import greedy_decode, src_mask_of
from fairseq_plugin.reference_weights import plain_model, right_padded
from fairseq_plugin.testing.operations import OperationCounter, counting_step_calls
from fairseq_plugin.testing.recomputing import cached_rows, without_cache


def padded_sources(d, lengths, left_pad):
    """A batch of sources of the given lengths (each ending in eos), padded left or right."""
    S = max(lengths)
    src = torch.full((len(lengths), S), d.pad())
    for i, n in enumerate(lengths):
        seq = torch.cat([random_tokens(d, 1, n - 1)[0], torch.tensor([d.eos()])])
        if left_pad:
            src[i, S - n:] = seq
        else:
            src[i, :n] = seq
    return src, torch.tensor(lengths)


def prefixes(d, batch, length):
    """Target prefixes as beam search builds them: eos first, then real tokens."""
    return torch.cat([torch.full((batch, 1), d.eos()), random_tokens(d, batch, length - 1)], 1)


@contextlib.contextmanager
def recording_beam_rows(model):
    """While inside, the number of hypotheses of each of beam search's reorders: fewer once a
    sentence has finished."""
    decoder, rows = model.decoder, []
    reorder = decoder.reorder_incremental_state_scripting
    wrapped = decoder.__dict__.get("reorder_incremental_state_scripting")  # by another recorder

    def recording(state, new_order):
        rows.append(new_order.numel())
        return reorder(state, new_order)

    decoder.reorder_incremental_state_scripting = recording
    try:
        yield rows
    finally:
        if wrapped is None:
            del decoder.reorder_incremental_state_scripting
        else:
            decoder.reorder_incremental_state_scripting = wrapped


def step_by_step(model, encoder_out, tokens, state=None):
    state = {} if state is None else state
    steps = [model.decoder(tokens[:, :t], encoder_out=encoder_out, incremental_state=state)[0]
             for t in range(1, tokens.size(1) + 1)]
    return torch.cat(steps, dim=1), state


@pytest.fixture(params=["left to the kernel", "as on a GPU"])
def rows_without_keys(request, monkeypatch):
    """Queries that may attend to no key (a left-padded target's padding, a cache's masked
    steps): left to torch >= 2.5's CPU kernel, which zeroes them, or handled as on a GPU (and
    torch < 2.5), where attention lets them see every key and gives their rows W^O's bias."""
    if request.param == "as on a GPU":
        monkeypatch.setattr(attention_module, "fused_kernel_zeroes_empty_rows", lambda q: False)
    return request.param


@pytest.mark.parametrize("left_pad", [True, False])
@pytest.mark.parametrize("post_norm", [False, True])
def test_step_by_step_logits_equal_one_full_pass_for_a_padded_batch(left_pad, post_norm,
                                                                    rows_without_keys):
    d = make_dictionary()
    model = build_tiny_model(d, post_norm=post_norm)
    src, lengths = padded_sources(d, [7, 3, 5, 1], left_pad)
    tgt = prefixes(d, 4, 9)
    with torch.no_grad():
        encoder_out = model.encoder(src, lengths)
        full = model.decoder(tgt, encoder_out=encoder_out)[0]
        incremental, _ = step_by_step(model, encoder_out, tgt)
    assert incremental.shape == full.shape == (4, 9, len(d))
    assert (incremental - full).abs().max() <= 1e-4


def test_padding_side_does_not_change_a_sentences_encoding():
    """fairseq-generate left-pads sources, training right-pads: same sentence, same output."""
    d = make_dictionary()
    model = build_tiny_model(d)
    torch.manual_seed(3)
    left, lengths = padded_sources(d, [6, 2, 4], left_pad=True)
    right = torch.full_like(left, d.pad())
    for i, n in enumerate(lengths.tolist()):
        right[i, :n] = left[i, left.size(1) - n:]
    tgt = prefixes(d, 3, 5)
    with torch.no_grad():
        out_left = model(left, lengths, tgt)[0]
        out_right = model(right, lengths, tgt)[0]
    assert (out_left - out_right).abs().max() <= 1e-5


@pytest.mark.parametrize("source_lengths", [[5, 8, 3], [6, 6, 6]], ids=["padded", "unpadded"])
@pytest.mark.parametrize("beam_size_told", [True, False])
def test_cache_follows_beam_reorders_and_a_shrinking_batch(beam_size_told, source_lengths):
    """Beam-search semantics: reorders within each sentence's group of hypotheses, then a
    sentence finishes and the batch shrinks; the cached logits still equal a full pass, with the
    hypotheses grouped (the model told the beam size, as SequenceGenerator does) or not, for
    padded sources and for sources of one length (no source mask to keep)."""
    d = make_dictionary()
    model = build_tiny_model(d)
    g = torch.Generator().manual_seed(1)
    bsz, beam = 3, 4
    model.decoder.need_attn = False  # no weights: the fused kernel in every attention
    if beam_size_told:
        model.set_beam_size(beam)
    src, lengths = padded_sources(d, source_lengths, left_pad=True)
    with torch.no_grad():
        encoder_out = model.encoder(src, lengths)
        assert bool(encoder_out["src_mask"]) == (len(set(source_lengths)) > 1)
        expand = torch.arange(bsz).repeat_interleave(beam)
        encoder_out = model.encoder.reorder_encoder_out(encoder_out, expand)
        tokens = torch.full((bsz * beam, 1), d.eos())
        state = {}
        active = list(range(bsz))
        for step in range(8):
            model.decoder(tokens, encoder_out=encoder_out, incremental_state=state)
            n = len(active)
            # each hypothesis continues one of its own sentence's hypotheses
            within = torch.randint(0, beam, (n, beam), generator=g)
            new_order = (torch.arange(n)[:, None] * beam + within).view(-1)
            if step == 4:  # sentence 1 finishes: keep the rows of sentences 0 and 2
                keep = torch.tensor([0, 2])
                new_order = new_order.view(n, beam)[keep].view(-1)
                active = [active[i] for i in keep.tolist()]
            model.decoder.reorder_incremental_state_scripting(state, new_order)
            encoder_out = model.encoder.reorder_encoder_out(encoder_out, new_order)
            tokens = torch.cat([tokens.index_select(0, new_order),
                                random_tokens(d, new_order.numel(), 1, generator=g)], dim=1)
        last_cached = model.decoder(tokens, encoder_out=encoder_out, incremental_state=state)[0]
        # the same histories decoded from scratch, against freshly encoded sources
        fresh = model.encoder(src[active].repeat_interleave(beam, 0),
                              lengths[active].repeat_interleave(beam))
        full = model.decoder(tokens, encoder_out=fresh)[0]
        groups = {m.cache(state).group for m in model.decoder.attentions()}
    assert groups == ({beam} if beam_size_told else {1})
    assert tokens.size(0) == 2 * beam
    assert (last_cached[:, -1] - full[:, -1]).abs().max() <= 1e-4


@pytest.mark.parametrize("dtype", CPU_AUTOCAST_DTYPES)
def test_grouped_beam_steps_under_autocast_equal_a_full_pass(dtype):
    """Under torch.autocast (half precision over fp32 weights, e.g. around the hub's generate)
    the keys are half while the ancestry was made in the weights' dtype: it follows the keys,
    and each step equals a full pass under autocast up to the dtype's rounding."""
    d = make_dictionary()
    model = build_tiny_model(d)
    model.decoder.need_attn = False
    model.set_beam_size(2)
    g = torch.Generator().manual_seed(2)
    src, lengths = padded_sources(d, [5, 7], left_pad=True)
    sentence = torch.arange(2).repeat_interleave(2)
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        encoder_out = model.encoder.reorder_encoder_out(model.encoder(src, lengths), sentence)
        tokens, state = torch.full((4, 1), d.eos()), {}
        for _ in range(6):
            step = model.decoder(tokens, encoder_out=encoder_out, incremental_state=state)[0]
            full = model.decoder(tokens, encoder_out=encoder_out)[0]
            assert step.dtype == full.dtype == dtype
            rounding = 4 * torch.finfo(dtype).eps * float(full.abs().max())
            assert (step[:, -1] - full[:, -1]).abs().max() <= rounding
            order = sentence * 2 + torch.randint(0, 2, (4,), generator=g)  # within groups
            model.decoder.reorder_incremental_state_scripting(state, order)
            encoder_out = model.encoder.reorder_encoder_out(encoder_out, order)
            tokens = torch.cat([tokens.index_select(0, order), random_tokens(d, 4, 1, g)], 1)
        ancestry = model.decoder.beam.ancestry(state)
    assert ancestry is not None and ancestry.mask.dtype == dtype
    assert {m.cache(state).group for m in model.decoder.attentions()} == {2}


def test_each_cache_is_reordered_exactly_once():
    d = make_dictionary()
    model = build_tiny_model(d)
    src, lengths = padded_sources(d, [4, 6, 5], left_pad=True)
    tgt = prefixes(d, 3, 3)
    with torch.no_grad():
        encoder_out = model.encoder(src, lengths)
        _, state = step_by_step(model, encoder_out, tgt)
        attentions = [m for m in model.decoder.modules() if isinstance(m, MultiHeadedAttention)]
        before = [cached_rows(m, state) for m in attentions]
        # rows from different sentences: everything must move; a cycle of 3, so that a cache
        # reordered twice (or three times) ends elsewhere than one reordered once
        new_order = torch.tensor([1, 2, 0])
        model.decoder.reorder_incremental_state_scripting(state, new_order)
        after = [cached_rows(m, state) for m in attentions]
    assert len(attentions) == 4  # 2 decoder layers x (self, source)
    for (k0, v0), (k1, v1) in zip(before, after):
        assert torch.equal(k1, k0.index_select(0, new_order))
        assert torch.equal(v1, v0.index_select(0, new_order))


def test_sequence_generator_beam4_gives_the_same_hypotheses_with_and_without_cache(
        rows_without_keys):
    d = make_dictionary(40)
    model = sharpen(build_tiny_model(d))
    recomputing = without_cache(model)
    src, lengths = padded_sources(d, [6, 9, 4, 7, 2], left_pad=True)
    sample = {"net_input": {"src_tokens": src, "src_lengths": lengths}}

    def generate(m):
        gen = SequenceGenerator([m], d, beam_size=4, max_len_b=12, normalize_scores=True)
        assert gen.model.has_incremental_states() == (m is model)
        with torch.no_grad():
            return gen.generate([m], sample)

    with recording_beam_rows(model) as rows:
        cached = generate(model)
    recomputed = generate(recomputing)
    assert rows[0] == 20 and min(rows) < 20  # sentences finish and leave the batch
    n_hypos = 0
    for hyps_a, hyps_b in zip(cached, recomputed):
        assert len(hyps_a) == len(hyps_b) == 4
        for a, b in zip(hyps_a, hyps_b):
            assert torch.equal(a["tokens"], b["tokens"])
            assert abs(float(a["score"]) - float(b["score"])) <= 1e-4
            assert torch.allclose(a["positional_scores"], b["positional_scores"], atol=1e-4)
            n_hypos += 1
    assert n_hypos == 20
    # the beams are not all the same hypothesis
    assert len({tuple(h["tokens"].tolist()) for h in cached[0]}) > 1


def test_reorders_are_classified_by_whether_rows_stay_in_their_groups_and_stored_rows_move():
    def plan(new_order, group, rows):
        kept, moves = plan_reorder(torch.tensor(new_order), group, rows)
        return (None if kept is None else kept.tolist()), moves

    assert plan([1, 0, 2, 5, 3, 3], 3, rows=2) == ([0, 1], False)  # within groups: nothing moves
    assert plan([1, 0, 2, 2, 5, 3], 3, rows=2) == (None, True)
    assert plan([3, 2, 2, 3], 2, rows=2) == ([1, 1], True)  # group 1 continues in both
    assert plan([5, 4], 2, rows=3) == ([2], True)  # sentences 0 and 1 finished
    assert plan([3, 0], 2, rows=2) == (None, True)  # row 1 takes another group's row
    assert plan([0, 1, 2], 2, rows=2) == (None, True)  # not whole groups
    assert plan([2, 0], 1, rows=3) == ([2, 0], True)  # each row its own group
    assert plan([0, 1], 1, rows=2) == ([0, 1], False)
    assert repeats_rows(torch.tensor([0, 0, 0, 1, 1, 1]), 3)
    assert not repeats_rows(torch.tensor([0, 0, 1, 1, 1, 1]), 3)
    assert not repeats_rows(torch.tensor([0, 1, 2, 3]), 2)


def test_a_stale_beam_size_does_not_group_different_sentences():
    """fairseq never resets the beam size: a greedy run after a beam run must not treat distinct
    sentences as one sentence's hypotheses."""
    d = make_dictionary(40)
    model = build_tiny_model(d)
    src, lengths = padded_sources(d, [6, 9, 4, 7], left_pad=True)
    sample = {"net_input": {"src_tokens": src, "src_lengths": lengths}}

    def greedy():
        gen = SequenceGenerator([model], d, beam_size=1, max_len_b=10)
        with torch.no_grad():
            return [h[0]["tokens"].tolist() for h in gen.generate([model], sample)]

    fresh = greedy()
    SequenceGenerator([model], d, beam_size=2)  # tells the model beam size 2, like fairseq
    assert model.encoder.beam.size == 2
    assert greedy() == fresh
    # (greedy search reorders nothing while no sentence finishes;) a reorder of distinct
    # sentences in pairs does not make groups of 2 either
    from fairseq_plugin.modules.beam import beam_group
    with torch.no_grad():
        swapped = model.encoder.reorder_encoder_out(model.encoder(src, lengths),
                                                    torch.tensor([1, 0, 3, 2]))
    assert beam_group(swapped) == 1


def test_source_keys_and_values_are_kept_once_per_sentence_and_not_copied_within_groups():
    d = make_dictionary()
    model = build_tiny_model(d)
    bsz, beam = 3, 4
    model.set_beam_size(beam)
    model.decoder.need_attn = False  # no weights: the fused kernel in every attention
    src, lengths = padded_sources(d, [5, 8, 3], left_pad=True)
    src_attns = [layer.src_attn for layer in model.decoder.layers]
    with torch.no_grad():
        encoder_out = model.encoder(src, lengths)
        encoder_out = model.encoder.reorder_encoder_out(
            encoder_out, torch.arange(bsz).repeat_interleave(beam))
        tokens = torch.full((bsz * beam, 1), d.eos())
        state = {}
        model.decoder(tokens, encoder_out=encoder_out, incremental_state=state)
        cached = [m.cache(state).k for m in src_attns]
        assert all(k.size(0) == bsz for k in cached)  # one row per sentence, not per hypothesis
        within = (torch.arange(bsz)[:, None] * beam + torch.tensor([3, 3, 0, 1])).view(-1)
        model.decoder.reorder_incremental_state_scripting(state, within)
        assert model.encoder.reorder_encoder_out(encoder_out, within) is encoder_out
        assert all(m.cache(state).k is k for m, k in zip(src_attns, cached))
        # sentence 1 finishes: the rows of sentences 0 and 2 remain
        shrink = torch.cat([torch.arange(beam), 2 * beam + torch.arange(beam)])
        model.decoder.reorder_incremental_state_scripting(state, shrink)
        for m, k in zip(src_attns, cached):
            assert torch.equal(m.cache(state).k, k[[0, 2]])
            keys, _ = cached_rows(m, state)
            assert torch.equal(keys, k[[0, 2]].repeat_interleave(beam, 0))


def sharp_tiny_model():
    return sharpen(build_tiny_model(make_dictionary(40)))


def beam_search_of_sharp_tiny_model(model=None, beam=4):
    model = model or sharp_tiny_model()
    d = model.decoder.dictionary
    src, lengths = padded_sources(d, [6, 9, 4], left_pad=True)
    gen = SequenceGenerator([model], d, beam_size=beam, max_len_b=10)
    with torch.no_grad():
        hypos = gen.generate([model], {"net_input": {"src_tokens": src, "src_lengths": lengths}})
    return d, model, src, lengths, hypos


def test_alignments_of_cached_beam_search_equal_a_full_pass_with_source_keys_still_grouped(
        monkeypatch):
    """Beam search's alignments (fairseq-generate, the hub, --eval-bleu's validation): the
    source attention's weights come from the grouped source cache, one row of keys per sentence,
    also once fairseq prepared the model for inference without --print-alignment (fairseq's
    transformer returns them then too)."""
    ungrouped, stored_in_groups_of = [], []
    ungroup, append = SourceAttentionCache.ungroup, SourceAttentionCache.append
    monkeypatch.setattr(SourceAttentionCache, "ungroup",
                        lambda self: (ungrouped.append(self.group), ungroup(self)))
    monkeypatch.setattr(SourceAttentionCache, "append", lambda self, *args: (
        stored_in_groups_of.append(self.group), append(self, *args)))
    model = sharp_tiny_model()
    model.prepare_for_inference_(OmegaConf.create({"generation": {"print_alignment": None}}))
    d, model, src, lengths, hypos = beam_search_of_sharp_tiny_model(model)
    assert stored_in_groups_of == [4, 4] and ungrouped == []  # 2 layers, beam 4
    for i, sentence in enumerate(hypos):
        for hypo in sentence:
            prev = torch.cat([torch.tensor([d.eos()]), hypo["tokens"][:-1]])[None]
            with torch.no_grad():
                attn = model(src[i:i + 1], lengths[i:i + 1], prev)[1]["attn"][0][0]  # (T, S)
            assert (attn.T - hypo["attention"]).abs().max() <= 1e-5


def test_a_beam_step_reads_the_device_once_shared_by_every_cache_and_the_encoder():
    """Whether a reorder moves rows is decided with one read per step, shared by every cache and
    by the encoder output (beam search hands both the same tensor); the decoder's step itself
    reads nothing (the source mask comes from the encoder, positions are checked against the
    limit from the row length)."""
    model = sharp_tiny_model()
    with counting_step_calls(model) as counts, recording_beam_rows(model) as rows:
        beam_search_of_sharp_tiny_model(model)
    assert min(rows) < max(rows)  # also at steps where sentences finish
    reads = {name: [n_reads for _, n_reads in calls] for name, calls in counts.items()}
    assert len(reads["forward"]) >= 5 and len(model.decoder.attentions()) == 4
    assert set(reads["forward"]) == {0}
    assert set(reads["reorder_incremental_state_scripting"]) == {1}
    # the encoder's first reorder is beam search's expansion (each sentence repeated), before
    # any decoder step: one read; each later one follows the decoder's plan
    assert reads["reorder_encoder_out"] == [1] + [0] * (len(reads["reorder_encoder_out"]) - 1)


@pytest.mark.parametrize("learned", [False, True], ids=["sinusoidal", "learned"])
def test_a_decoding_step_adds_the_full_pass_positional_encoding_without_launching_a_lookup(
        learned):
    """A decoding step's new token stands at position T - 1 in every row: it gets the encoding a
    full pass gives it, and the step launches only the sum (the table's row is a view)."""
    d = make_dictionary()
    embed = build_tiny_model(d, decoder_learned_pos=learned).decoder.embed
    prefix = random_tokens(d, 3, 6)
    with torch.no_grad():
        full = embed(prefix, embed.positions(prefix))[:, -1:]
        with OperationCounter() as step:
            newest = embed(prefix[:, -1:], embed.step_position(prefix))
        with OperationCounter() as without_positions:
            embed.embeddings(prefix[:, -1:])
    assert torch.equal(newest, full)
    assert step.launches == without_positions.launches + 1


def test_the_beams_ancestry_is_one_for_all_layers_and_reordered_once_per_step():
    """Every self-attention cache reads the same ancestry, given one step per decoder step and
    reordered with the hypotheses; a step's reorder launches as many operations with 3 layers as
    with 1."""
    launches = {}
    for layers in (1, 3):
        model = sharpen(build_tiny_model(make_dictionary(40), decoder_layers=layers))
        with counting_step_calls(model) as counts:
            beam_search_of_sharp_tiny_model(model)
        steps = counts["reorder_incremental_state_scripting"]
        launches[layers] = statistics.mode(n for n, _ in steps)  # a step where no beam ends
    assert launches[1] == launches[3]
    state = {}
    model = sharp_tiny_model()
    model.set_beam_size(2)
    src, lengths = padded_sources(model.decoder.dictionary, [5, 3], left_pad=True)
    with torch.no_grad():
        encoder_out = model.encoder.reorder_encoder_out(model.encoder(src, lengths),
                                                        torch.arange(2).repeat_interleave(2))
        model.decoder(torch.full((4, 1), 2), encoder_out=encoder_out, incremental_state=state)
    ancestries = [layer.self_attn.cache(state).ancestry for layer in model.decoder.layers]
    ancestry = ancestries[0]
    assert ancestry is not None and all(a is ancestry for a in ancestries)
    assert ancestry.steps == 1
    before, new_order = ancestry.mask.clone(), torch.tensor([1, 1, 3, 2])  # within the groups
    model.decoder.reorder_incremental_state_scripting(state, new_order)
    assert torch.equal(ancestry.mask, before.index_select(0, new_order))


@pytest.mark.parametrize("source_lengths", [[6, 4], [5, 5]], ids=["padded", "unpadded"])
def test_steps_after_reorders_within_and_then_across_groups_equal_a_full_pass(source_lengths):
    """Reorders within the beam's groups (one given twice between two steps), then a row taking
    another sentence's hypothesis: the caches fall back to one row per hypothesis, the decoder
    drops the ancestry, and each step's logits still equal a full pass over each row's prefix
    (with a source mask to ungroup, or none)."""
    d = make_dictionary()
    model = build_tiny_model(d, decoder_layers=2)
    model.set_beam_size(2)
    src, lengths = padded_sources(d, source_lengths, left_pad=True)
    sentence = torch.arange(2).repeat_interleave(2)  # each row's sentence
    orders = [[[1, 1, 2, 3]], [[3, 2, 1, 0], [1, 0, 3, 2]], [[0, 1, 3, 3]], [[0, 2, 2, 3]],
              [[1, 0, 3, 2]]]
    with torch.no_grad():
        encoder_out = model.encoder.reorder_encoder_out(model.encoder(src, lengths), sentence)
        tokens, state, grouped = torch.full((4, 1), d.eos()), {}, []
        for reorders in orders + [[]]:
            step = model.decoder(tokens, encoder_out=encoder_out, incremental_state=state)[0]
            full = model.decoder(tokens, model.encoder(src[sentence], lengths[sentence]))[0]
            assert (step[:, -1] - full[:, -1]).abs().max() <= 1e-5
            grouped.append(model.decoder.beam.ancestry(state) is not None)
            for order in map(torch.tensor, reorders):
                model.decoder.reorder_incremental_state_scripting(state, order)
                encoder_out = model.encoder.reorder_encoder_out(encoder_out, order)
                tokens, sentence = tokens.index_select(0, order), sentence.index_select(0, order)
            tokens = torch.cat([tokens, random_tokens(d, 4, 1)], 1)
    assert grouped == [True, True, True, True, False, False]
    assert {m.cache(state).group for m in model.decoder.attentions()} == {1}


def test_the_ancestry_is_dropped_once_no_cache_reads_it():
    """Attention weights from every self-attention (heat-maps) ungroup each cache in the first
    step; the next reorder drops the beam's ancestry instead of reordering it for nobody, and the
    steps after it still equal a full pass."""
    from fairseq_plugin.modules.attention import recording_attention

    d = make_dictionary()
    model = build_tiny_model(d, decoder_layers=2)
    model.set_beam_size(2)
    src, lengths = padded_sources(d, [6, 4], left_pad=True)
    sentence = torch.arange(2).repeat_interleave(2)
    order = torch.tensor([1, 1, 3, 2])  # within the groups
    with torch.no_grad(), recording_attention(model.decoder):
        encoder_out = model.encoder.reorder_encoder_out(model.encoder(src, lengths), sentence)
        tokens, state = torch.full((4, 1), d.eos()), {}
        model.decoder(tokens, encoder_out=encoder_out, incremental_state=state)
        assert model.decoder.beam.ancestry(state) is not None
        model.decoder.reorder_incremental_state_scripting(state, order)
        assert model.decoder.beam.ancestry(state) is None
        encoder_out = model.encoder.reorder_encoder_out(encoder_out, order)
        tokens = torch.cat([tokens.index_select(0, order), random_tokens(d, 4, 1)], 1)
        step = model.decoder(tokens, encoder_out=encoder_out, incremental_state=state)[0]
        full = model.decoder(tokens, model.encoder(src[sentence[order]],
                                                   lengths[sentence[order]]))[0]
    assert (step[:, -1] - full[:, -1]).abs().max() <= 1e-5


def test_masks_handed_to_attention_in_beam_search_have_aligned_rows(monkeypatch):
    """On a GPU, torch's memory-efficient attention kernel copies a mask whose rows are not a
    multiple of 8 elements apart, at every call: the caches keep theirs aligned, for a source of
    odd length and for the ancestry past its first capacity (beam 5, 40 steps)."""
    import fairseq_plugin.modules.attention as attention_module

    strides = []

    def recording_attend(q, k, v, mask, *args, **kwargs):
        if mask is not None and mask.dtype != torch.bool:
            strides.append(mask.stride())
        return attend(q, k, v, mask, *args, **kwargs)

    attend = attention_module.attend
    monkeypatch.setattr(attention_module, "attend", recording_attend)
    model = sharp_tiny_model()
    d = model.decoder.dictionary
    src, lengths = padded_sources(d, [5, 3], left_pad=True)  # S = 5
    gen = SequenceGenerator([model], d, beam_size=5, min_len=40, max_len_a=0, max_len_b=40)
    with torch.no_grad():
        gen.generate([model], {"net_input": {"src_tokens": src, "src_lengths": lengths}})
    assert len(strides) >= 2 * 2 * 40  # 2 layers x (self, source) x 40 steps
    misaligned = {st for st in strides if st[-1] != 1 or any(x % 8 for x in st[:-1])}
    assert misaligned == set()


def test_reorders_share_plans_only_for_the_same_unchanged_tensor():
    plans = ReorderPlans()
    order = torch.tensor([1, 0, 2, 3])
    first = plans.reorder(order).plan(2, 2)
    assert plans.reorder(order).plan(2, 2) is first  # the encoder after the decoder
    assert ReorderPlans().reorder(order).plan(2, 2) is not first  # another model's: its own
    order.view(2, 2).add_(torch.tensor([[0, 2], [0, 0]]))  # changed in place: [1, 2, 2, 3]
    kept, moves = plans.reorder(order).plan(2, 2)
    assert kept is None and moves  # a row of the first sentence now continues the second's
    assert plans.reorder(torch.tensor([1, 0, 2, 3])).plan(2, 2) is not first  # another tensor


def test_a_models_encoder_and_decoder_share_one_beam_search_state():
    model = build_tiny_model()
    assert model.encoder.beam is model.decoder.beam
    assert build_tiny_model().encoder.beam is not model.encoder.beam


def test_beam_search_under_inference_mode_equals_no_grad():
    """Tensors made under torch.inference_mode keep no version counter: reorders do not share
    plans there, and the beams are the same."""
    model = sharp_tiny_model()
    d = model.decoder.dictionary
    src, lengths = padded_sources(d, [6, 9, 4], left_pad=True)
    sample = {"net_input": {"src_tokens": src, "src_lengths": lengths}}
    gen = SequenceGenerator([model], d, beam_size=4, max_len_b=10)
    with torch.no_grad():
        expected = gen.generate([model], sample)
    with torch.inference_mode():
        hypos = gen.generate([model], sample)
    for hyps_a, hyps_b in zip(expected, hypos):
        assert [h["tokens"].tolist() for h in hyps_a] == [h["tokens"].tolist() for h in hyps_b]


def test_operation_counter_counts_launches_and_host_reads_but_not_views_or_host_tensors():
    x = torch.arange(6.0)
    with OperationCounter() as counter:
        y = x.view(2, 3).t()  # views: nothing launched
        z = (y * 2).sum()  # two launches
        bool(z > 1)  # a launch and a read
        x.tolist()  # a read
        int(torch.tensor(3))  # made on the host: not a read
    assert (counter.launches, counter.reads) == (3, 2)


def test_cached_greedy_decoding_equals_the_notebooks_greedy_decode():
    """The notebook's greedy decoding (the whole prefix re-run at every step) by the plain model
    with the same weights (reference.py) is the oracle."""
    d = make_dictionary(40)
    model = build_tiny_model(d)
    with torch.no_grad():
        model.decoder.generator.proj.weight.mul_(4.0)
    src, lengths = padded_sources(d, [6, 9, 4], left_pad=True)
    plain_src = right_padded(src, d.pad())
    expected = greedy_decode(plain_model(model), plain_src, src_mask_of(plain_src, d.pad()),
                             max_len=9, start_symbol=d.eos())[:, 1:]
    with torch.no_grad():
        encoder_out, state = model.encoder(src, lengths), {}
        ys = torch.full((3, 1), d.eos())
        for _ in range(8):
            logits = model.decoder(ys, encoder_out=encoder_out, incremental_state=state)[0]
            ys = torch.cat([ys, logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(ys[:, 1:], expected)
    assert len(set(map(tuple, expected.tolist()))) > 1


@contextlib.contextmanager
def count_kernels():
    """{kernel: calls} of every attention while inside."""
    from fairseq_plugin.modules import attention

    counts, attend = {FUSED: 0, EXPLICIT: 0}, attention.attend

    def counted(q, k, v, mask, causal, dropout, kernel):
        counts[kernel] += 1
        return attend(q, k, v, mask, causal, dropout, kernel)

    attention.attend = counted
    try:
        yield counts
    finally:
        attention.attend = attend


def test_fused_kernel_in_decoding_steps_equals_the_written_out_formula():
    """Decoding steps with the fused kernel in every attention (as fairseq-generate runs them,
    no alignment asked for) give the beams of the written-out formula."""
    d = make_dictionary(40)
    model = sharpen(build_tiny_model(d))
    model.decoder.need_attn = False  # no weights: the fused kernel in every attention
    src, lengths = padded_sources(d, [6, 9, 4, 7, 2], left_pad=True)
    sample = {"net_input": {"src_tokens": src, "src_lengths": lengths}}

    def beam4(kernel):
        model.force_attention_kernel(kernel)
        gen = SequenceGenerator([model], d, beam_size=4, max_len_b=12)
        with torch.no_grad(), count_kernels() as kernels:
            return gen.generate([model], sample), kernels

    (fused, fused_kernels), (explicit, explicit_kernels) = beam4(FUSED), beam4(EXPLICIT)
    assert fused_kernels[EXPLICIT] == 0 < fused_kernels[FUSED]
    assert explicit_kernels[FUSED] == 0 < explicit_kernels[EXPLICIT]
    assert len({tuple(h["tokens"].tolist()) for hyps in fused for h in hyps}) > 5  # not trivial
    for hyps_a, hyps_b in zip(explicit, fused):
        for a, b in zip(hyps_a, hyps_b):
            assert torch.equal(a["tokens"], b["tokens"])
            assert abs(float(a["score"]) - float(b["score"])) <= 1e-4


def test_encoder_reorders_copy_only_when_rows_change_and_mark_only_true_copies():
    from fairseq_plugin.modules.beam import beam_group

    d = make_dictionary()
    model = build_tiny_model(d)
    model.set_beam_size(2)
    src, lengths = padded_sources(d, [5, 3, 4, 6], left_pad=True)
    reorder = model.encoder.reorder_encoder_out
    with torch.no_grad():
        enc = model.encoder(src, lengths)
    x = enc["encoder_out"][0]
    # distinct sentences, an even number of rows: never marked as copies of one another
    once = reorder(enc, torch.tensor([3, 1, 0, 2]))
    twice = reorder(once, torch.tensor([1, 0, 3, 2]))
    assert beam_group(once) == beam_group(twice) == 1
    assert torch.equal(twice["encoder_out"][0], x[[3, 1, 0, 2]][[1, 0, 3, 2]])
    # beam search's expansion makes groups of copies; reorders within them copy nothing
    expanded = reorder(enc, torch.arange(4).repeat_interleave(2))
    assert beam_group(expanded) == 2
    assert reorder(expanded, torch.tensor([1, 1, 2, 3, 5, 4, 6, 6])) is expanded
    shrunk = reorder(expanded, torch.tensor([3, 2, 7, 7]))  # sentences 0 and 2 finished
    assert beam_group(shrunk) == 2
    assert torch.equal(shrunk["encoder_out"][0], x[[1, 1, 3, 3]])
    crossed = reorder(expanded, torch.tensor([0, 2, 2, 3, 4, 5, 6, 7]))  # row 1 leaves its group
    assert beam_group(crossed) == 1
    assert torch.equal(crossed["encoder_out"][0], x[[0, 1, 1, 1, 2, 2, 3, 3]])


SEARCHES = ["prefix", "constraints", "diverse beam groups", "diverse siblings", "sampling"]


@pytest.mark.parametrize("kind", SEARCHES)
def test_fairseqs_other_searches_give_the_same_hypotheses_with_and_without_cache(kind):
    """Prefixes (--prefix-size), constraints (--constraints), diverse beam search
    (--diverse-beam-groups, --diversity-rate) and sampling (--sampling) each reorder the beam in
    their own pattern; none may see a difference between the cache and the full prefix."""
    from fairseq import search
    from fairseq.token_generation_constraints import pack_constraints

    d = make_dictionary(40)
    model = sharpen(build_tiny_model(d))
    src, lengths = padded_sources(d, [6, 9, 4], left_pad=True)
    sample = {"net_input": {"src_tokens": src, "src_lengths": lengths}}
    options, extra = {}, {}
    if kind == "prefix":
        extra["prefix_tokens"] = random_tokens(d, 3, 2)
    elif kind == "constraints":
        options["search_strategy"] = search.LexicallyConstrainedBeamSearch(d, "ordered")
        phrases = [[random_tokens(d, 1, 2)[0]], [random_tokens(d, 1, 1)[0]], []]
        extra["constraints"] = pack_constraints(phrases)
    elif kind == "diverse beam groups":
        options["search_strategy"] = search.DiverseBeamSearch(d, 2, diversity_strength=0.5)
    elif kind == "diverse siblings":
        options["search_strategy"] = search.DiverseSiblingsSearch(d, diversity_rate=0.5)
    else:
        options["search_strategy"] = search.Sampling(d, sampling_topk=10)

    def generate(m):
        gen = SequenceGenerator([m], d, beam_size=4, max_len_b=10, **options)
        torch.manual_seed(7)  # the same draws for both (sampling)
        with torch.no_grad():
            return gen.generate([m], sample, **extra)

    cached, recomputed = generate(model), generate(without_cache(model))
    for hyps_a, hyps_b in zip(cached, recomputed):
        assert [h["tokens"].tolist() for h in hyps_a] == [h["tokens"].tolist() for h in hyps_b]
        for a, b in zip(hyps_a, hyps_b):
            assert abs(float(a["score"]) - float(b["score"])) <= 1e-4
    # each search really searched: the beams hold different hypotheses
    assert any(len({tuple(h["tokens"].tolist()) for h in hyps}) > 1 for hyps in cached)
    if kind == "prefix":
        assert all(torch.equal(h["tokens"][:2], p) for hs, p in zip(cached, extra["prefix_tokens"])
                   for h in hs)
    elif kind == "constraints":  # every hypothesis holds its sentence's constraint, in order
        for hyps, phrase in zip(cached, ([int(t) for t in c[0]] if c else [] for c in phrases)):
            for h in hyps:
                tokens = h["tokens"].tolist()
                assert any(tokens[i:i + len(phrase)] == phrase for i in range(len(tokens))), phrase


def test_an_ensemble_of_two_models_gives_the_same_hypotheses_with_and_without_cache():
    """fairseq-generate --path a.pt:b.pt: each model keeps its own cache in the ensemble."""
    d = make_dictionary(40)
    torch.manual_seed(1)
    first = build_tiny_model(d)
    torch.manual_seed(2)
    second = build_tiny_model(d)
    sharpen(first), sharpen(second)
    src, lengths = padded_sources(d, [6, 9, 4, 7], left_pad=True)
    sample = {"net_input": {"src_tokens": src, "src_lengths": lengths}}

    def generate(models):
        gen = SequenceGenerator(models, d, beam_size=4, max_len_b=10)
        with torch.no_grad():
            return gen.generate(models, sample)

    cached = generate([first, second])
    recomputed = generate([without_cache(first), without_cache(second)])
    alone = generate([first])
    for hyps_a, hyps_b in zip(cached, recomputed):
        assert [h["tokens"].tolist() for h in hyps_a] == [h["tokens"].tolist() for h in hyps_b]
        for a, b in zip(hyps_a, hyps_b):
            assert abs(float(a["score"]) - float(b["score"])) <= 1e-4
    # the second model takes part: the ensemble's scores are not the first model's alone
    assert any(abs(float(a[0]["score"]) - float(b[0]["score"])) > 1e-3
               for a, b in zip(cached, alone))


@pytest.mark.parametrize("beam", [1, 2], ids=["one row per sentence", "grouped beam"])
@pytest.mark.parametrize("kernel", [FUSED, "explicit"])
def test_several_new_steps_after_cached_ones_see_each_other_causally(kernel, beam,
                                                                  rows_without_keys):
    """Self-attention with a cache and T > 1 new queries: each sees the cached steps and the new
    ones up to itself (the causal mask aligned to the last T positions, for both kernels); a
    cache holding a beam's groups first falls back to one row per hypothesis."""
    d = make_dictionary()
    model = build_tiny_model(d)
    model.set_beam_size(beam)
    for m in model.decoder.attentions():
        m.force_kernel(kernel)
    src, lengths = padded_sources(d, [5, 7], left_pad=True)
    rows = 2 * beam
    tgt = prefixes(d, rows, 6)  # the hypotheses of one sentence differ after eos
    with torch.no_grad():
        encoder_out = model.encoder.reorder_encoder_out(
            model.encoder(src, lengths), torch.arange(2).repeat_interleave(beam))
        full = model.decoder(tgt, encoder_out=encoder_out)[0]
        state = {}
        for t in (1, 2):  # two cached steps, then four at once through the layers
            model.decoder(tgt[:, :t], encoder_out=encoder_out, incremental_state=state)
        assert {m.cache(state).group for m in model.decoder.attentions()} == {beam}
        x = model.decoder.embed(tgt[:, 2:], torch.arange(2, 6).expand(rows, 4))
        for layer in model.decoder.layers:
            x, _ = layer(x, encoder_out["encoder_out"][0], source_mask(encoder_out), None, state)
        out = model.decoder.output_layer(model.decoder.norm(x))
        assert {layer.self_attn.cache(state).group for layer in model.decoder.layers} == {1}
    assert (out - full[:, 2:]).abs().max() <= 1e-4


@pytest.mark.parametrize("beam_size_told", [True, False])
def test_a_step_after_every_sentence_finished_returns_an_empty_batch(beam_size_told):
    """A reorder may drop every row (all sentences finished); fairseq's SequenceGenerator stops
    there, but the decoder, its caches and the encoder output accept the empty batch."""
    d = make_dictionary()
    model = build_tiny_model(d)
    bsz, beam = 2, 3
    if beam_size_told:
        model.set_beam_size(beam)
    src, lengths = padded_sources(d, [5, 3], left_pad=True)
    with torch.no_grad():
        encoder_out = model.encoder(src, lengths)
        expand = torch.arange(bsz).repeat_interleave(beam)
        encoder_out = model.encoder.reorder_encoder_out(encoder_out, expand)
        state = {}
        tokens = torch.full((bsz * beam, 1), d.eos())
        model.decoder(tokens, encoder_out=encoder_out, incremental_state=state)
        empty = torch.zeros(0, dtype=torch.long)
        model.decoder.reorder_incremental_state_scripting(state, empty)
        encoder_out = model.encoder.reorder_encoder_out(encoder_out, empty)
        tokens = torch.cat([tokens, random_tokens(d, bsz * beam, 1)], 1).index_select(0, empty)
        logits = model.decoder(tokens, encoder_out=encoder_out, incremental_state=state)[0]
    assert logits.shape == (0, 1, len(d))


def test_fairseqs_multilingual_task_decodes_the_same_with_and_without_cache(tmp_path):
    """fairseq's translation_multi_simple_epoch (one model for several directions, a language
    token on the source and one forced first on the target): its beam search over the cache
    equals the recomputed one, and every hypothesis begins with the target language's token."""
    from fairseq import options, tasks, utils

    data_bin = reverse_data_bin(tmp_path, "--train", 50, "--valid", 20, "--test", 20)
    common = [str(data_bin), "--user-dir", PLUGIN_DIR, "--task", "translation_multi_simple_epoch",
              "--lang-pairs", "src-tgt,tgt-src", "--source-lang", "tgt", "--target-lang", "src",
              "--encoder-langtok", "src", "--decoder-langtok", "--max-tokens", "1000", "--cpu"]
    train_args = options.parse_args_and_arch(options.get_training_parser(),
                                             common + ["--arch", "annotated_transformer_tiny"])
    generate_args = options.parse_args_and_arch(options.get_generation_parser(),
                                                common + ["--beam", "4", "--max-len-b", "20"])
    task = tasks.setup_task(train_args)
    task.load_dataset("test")
    torch.manual_seed(1)  # a model whose hypotheses end at different steps
    model = sharpen(task.build_model(train_args)).eval()
    batches = task.get_batch_iterator(
        dataset=task.dataset("test"), max_tokens=1000,
        max_positions=utils.resolve_max_positions(task.max_positions(), model.max_positions()))
    sample = next(batches.next_epoch_itr(shuffle=False))

    def beam_search(m):
        with torch.no_grad():
            return task.inference_step(task.build_generator([m], generate_args), [m], sample)

    with recording_beam_rows(model) as rows:
        cached = beam_search(model)
    recomputed = beam_search(without_cache(model))
    assert rows[0] == 80 and min(rows) < 80  # sentences finish and leave the batch
    assert len(cached) == 20
    target_language = task.source_dictionary.index("__src__")
    for hyps_a, hyps_b in zip(cached, recomputed):
        assert [h["tokens"].tolist() for h in hyps_a] == [h["tokens"].tolist() for h in hyps_b]
        for a, b in zip(hyps_a, hyps_b):
            assert abs(float(a["score"]) - float(b["score"])) <= 1e-4
            assert int(a["tokens"][0]) == target_language
