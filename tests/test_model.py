"""The model as fairseq builds it: sharing, gradients, bad configurations."""

import math
import os
from argparse import Namespace

import pytest
import torch

import fairseq_plugin
from fairseq_plugin import reference
from fairseq_plugin.modules.embeddings import SinusoidalPositionalEncoding
from conftest import build_tiny_model, exit_code, make_dictionary, random_tokens
from fairseq_plugin.criterions.annotated_label_smoothing import AnnotatedLabelSmoothingCriterion
from fairseq_plugin.errors import PluginError
from fairseq_plugin.torch_release import TORCH_RELEASE


def training_sample(d, batch=4, src_len=7, tgt_len=6):
    src = random_tokens(d, batch, src_len)
    src[0, :2] = d.pad()  # left padding in one row
    tgt = random_tokens(d, batch, tgt_len)
    tgt[1, -2:] = d.pad()
    prev = torch.cat([torch.full((batch, 1), d.eos()), tgt[:, :-1]], 1)
    return {"net_input": {"src_tokens": src, "src_lengths": src.ne(d.pad()).sum(1),
                          "prev_output_tokens": prev},
            "target": tgt, "ntokens": int(tgt.ne(d.pad()).sum())}


@pytest.mark.parametrize("sharing", [{}, {"share_all_embeddings": True},
                                     {"share_decoder_input_output_embed": True},
                                     {"post_norm": True, "encoder_learned_pos": True,
                                      "decoder_learned_pos": True}])
def test_every_parameter_receives_a_gradient(sharing):
    """So PyTorch DDP needs no find_unused_parameters."""
    d = make_dictionary()
    model = build_tiny_model(d, **sharing).train()
    crit = AnnotatedLabelSmoothingCriterion(Namespace(target_dictionary=d), sentence_avg=False,
                                            label_smoothing=0.1)
    loss, _, _ = crit(model, training_sample(d))
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == []


def test_share_all_embeddings_ties_source_target_and_output():
    model = build_tiny_model(share_all_embeddings=True)
    w = model.encoder.embed.embeddings.lut.weight
    assert model.decoder.embed.embeddings.lut.weight is w
    assert model.decoder.generator.proj.weight is w


def test_no_buffers_to_broadcast_and_nothing_created_in_forward():
    d = make_dictionary()
    model = build_tiny_model(d)
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    model(**training_sample(d)["net_input"])
    # one buffer, which forward never reads: the fingerprint of the dictionaries (checkpoints)
    assert [name for name, _ in model.named_buffers()] == ["dictionary_fingerprint"]
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == before


def test_presets_have_the_papers_sizes():
    from fairseq.models import MODEL_REGISTRY

    def preset(name, **given):
        """(encoder's (N, d_model, d_ff, h), decoder's, dropout) of a preset given ``given``."""
        args = MODEL_REGISTRY[name].options(Namespace(**given))
        return ((args.encoder_layers, args.encoder_embed_dim, args.encoder_ffn_embed_dim,
                 args.encoder_attention_heads),
                (args.decoder_layers, args.decoder_embed_dim, args.decoder_ffn_embed_dim,
                 args.decoder_attention_heads),
                args.dropout)

    for name, sizes, dropout in [("annotated_transformer", (6, 512, 2048, 8), 0.1),
                                 ("annotated_transformer_iwslt_de_en", (6, 512, 1024, 4), 0.1),
                                 ("annotated_transformer_big", (6, 1024, 4096, 16), 0.3),
                                 ("annotated_transformer_tiny", (2, 64, 256, 4), 0.1)]:
        assert preset(name) == (sizes, sizes, dropout), name
    # what the user gives is kept, and only that
    assert preset("annotated_transformer_big", dropout=0.0, encoder_layers=3) == (
        (3, 1024, 4096, 16), (6, 1024, 4096, 16), 0.0)


def test_pre_ln_by_default_post_ln_on_request_and_fairseqs_normalize_before_flags_per_stack():
    def sublayers(model):
        return [s for stack in (model.encoder, model.decoder) for layer in stack.layers
                for s in layer.sublayer]

    pre = build_tiny_model()
    assert pre.encoder.norm is not None and pre.decoder.norm is not None
    assert len(sublayers(pre)) == 2 * 2 + 2 * 3 and all(s.normalize_before for s in sublayers(pre))
    post = build_tiny_model(post_norm=True)
    assert post.encoder.norm is None and post.decoder.norm is None
    assert not any(s.normalize_before for s in sublayers(post))
    # fairseq's flags keep their meaning: pre-LN in the stack they name, post-LN in the other
    for flag, pre_ln_stack in (("encoder_normalize_before", "encoder"),
                               ("decoder_normalize_before", "decoder")):
        model = build_tiny_model(**{flag: True})
        for stack in (model.encoder, model.decoder):
            pre_ln = stack is getattr(model, pre_ln_stack)
            assert (stack.norm is not None) == pre_ln, (flag, stack)
            assert [s.normalize_before for layer in stack.layers for s in layer.sublayer] == [
                pre_ln] * len(stack.layers) * len(stack.layers[0].sublayer), (flag, stack)
    both = build_tiny_model(encoder_normalize_before=True, decoder_normalize_before=True)
    assert all(s.normalize_before for s in sublayers(both))
    # and what each computes: x + Sublayer(LayerNorm(x)) / LayerNorm(x + Sublayer(x))
    x, double = torch.randn(3, 64), (lambda y: 2 * y)
    pre_ln, post_ln = sublayers(pre)[0].eval(), sublayers(post)[0].eval()
    assert torch.allclose(pre_ln(x, double), x + 2 * pre_ln.norm(x))
    assert torch.allclose(post_ln(x, double), post_ln.norm(3 * x))


def test_heads_not_dividing_d_model_is_a_clear_error():
    with pytest.raises(PluginError, match="--encoder-embed-dim 64 is not divisible by "
                                          "--encoder-attention-heads 5"):
        build_tiny_model(encoder_attention_heads=5)
    with pytest.raises(PluginError, match="--decoder-embed-dim 64 is not divisible by "
                                          "--decoder-attention-heads 3; .* \\(e.g. 2\\)"):
        build_tiny_model(decoder_attention_heads=3)


def test_a_decoder_without_layers_or_a_negative_layer_count_is_a_clear_error():
    with pytest.raises(PluginError, match="--decoder-layers 0: the decoder needs at least one "
                                          "layer; use e.g. 6"):
        build_tiny_model(decoder_layers=0)
    with pytest.raises(PluginError, match="--encoder-layers -1 is not a number of layers"):
        build_tiny_model(encoder_layers=-1)
    d = make_dictionary()
    model = build_tiny_model(d, encoder_layers=0)  # embeddings and the final LayerNorm: decodes
    src = random_tokens(d, 2, 5)
    tgt = torch.cat([torch.full((2, 1), d.eos()), random_tokens(d, 2, 3)], 1)
    with torch.no_grad():
        encoder_out = model.encoder(src)
        full = model.decoder(tgt, encoder_out=encoder_out)[0]
        state = {}
        steps = [model.decoder(tgt[:, :t], encoder_out=encoder_out, incremental_state=state)[0]
                 for t in range(1, 5)]
    assert (torch.cat(steps, 1) - full).abs().max() <= 1e-4


def test_a_misspelled_model_option_is_refused_with_the_closest_name():
    from omegaconf import OmegaConf
    from fairseq_plugin.models.annotated_transformer import AnnotatedTransformerModel
    misspelled = OmegaConf.create({"_name": "annotated_transformer", "encoder_layer": 1})
    with pytest.raises(PluginError, match=r"unknown model option 'encoder_layer' "
                                          r"\(model.encoder_layer\), not a field of "
                                          r"AnnotatedTransformerConfig; did you mean "
                                          r"encoder_layers\?"):
        AnnotatedTransformerModel.options(misspelled)
    unlike_any = OmegaConf.create({"_name": "annotated_transformer", "xyz": 1})
    with pytest.raises(PluginError, match="check its spelling .docs/reference.md"):
        AnnotatedTransformerModel.options(unlike_any)


def test_share_all_embeddings_needs_a_joined_dictionary():
    with pytest.raises(PluginError, match="--joined-dictionary"):
        build_tiny_model(make_dictionary(30), make_dictionary(31), share_all_embeddings=True)
    renamed = make_dictionary(30)  # as many symbols, but not the same ones
    renamed.symbols[-1] = "another"
    renamed.indices = {symbol: i for i, symbol in enumerate(renamed.symbols)}
    with pytest.raises(PluginError, match="--joined-dictionary"):
        build_tiny_model(make_dictionary(30), renamed, share_all_embeddings=True)
    build_tiny_model(make_dictionary(30), make_dictionary(30), share_all_embeddings=True)  # equal


def test_share_all_embeddings_needs_equal_widths():
    with pytest.raises(PluginError, match=r"--encoder-embed-dim \(32\) equal to "
                                          r"--decoder-embed-dim \(64\)"):
        build_tiny_model(share_all_embeddings=True, encoder_embed_dim=32, decoder_embed_dim=64)


def test_alignment_supervision_is_refused_in_one_line():
    """label_smoothed_cross_entropy_with_alignment reads the decoder's attention in training,
    which this model does not return: --load-alignments is refused before training starts."""
    from fairseq.models import MODEL_REGISTRY
    from fairseq.tasks.translation import TranslationConfig, TranslationTask

    d = make_dictionary()
    model = MODEL_REGISTRY["annotated_transformer_tiny"]
    assert model.build_model(Namespace(), TranslationTask(TranslationConfig(), d, d))
    with pytest.raises(PluginError, match="^--load-alignments: alignment supervision reads the "
                                          "decoder's attention weights in training, which "
                                          "annotated_transformer does not return; drop"):
        model.build_model(Namespace(), TranslationTask(TranslationConfig(load_alignments=True),
                                                       d, d))


def test_post_norm_conflicts_with_normalize_before():
    with pytest.raises(PluginError, match="--post-norm conflicts"):
        build_tiny_model(post_norm=True, encoder_normalize_before=True)


def test_a_checkpoint_with_parameters_this_model_lacks_is_refused_in_one_line():
    learned = build_tiny_model(encoder_learned_pos=True).state_dict()
    sinusoids = build_tiny_model()
    with pytest.raises(PluginError, match="has encoder.embed.positional.embed.weight, which this "
                                          "model lacks.* --arch or other flags"):
        sinusoids.load_state_dict(learned)
    sinusoids.load_state_dict(learned, strict=False)  # not strict: ignored, as torch does
    assert torch.equal(sinusoids.encoder.layers[0].self_attn.qkv_proj.weight,
                       learned["encoder.layers.0.self_attn.qkv_proj.weight"])


# a fairseq-train checkpoint written before the readable-core redesign, and what it loads with
PRE_REDESIGN = os.path.join(os.path.dirname(__file__), "data", "pre_redesign")
PRE_REDESIGN_OVERRIDES = {"data": PRE_REDESIGN, "source_lang": "src", "target_lang": "tgt"}


def tiny_training_args(tmp_path, dictionary, *flags):
    """fairseq-train's parsed arguments for annotated_transformer_tiny on ``dictionary`` (saved
    under tmp_path for de and en), with ``flags``."""
    from fairseq import options

    dictionary.save(str(tmp_path / "dict.de.txt"))
    dictionary.save(str(tmp_path / "dict.en.txt"))
    command = [str(tmp_path), "--arch", "annotated_transformer_tiny", "--source-lang", "de",
               "--target-lang", "en", "--user-dir", os.path.dirname(fairseq_plugin.__file__),
               *flags]
    return options.parse_args_and_arch(options.get_training_parser(), command)


def test_a_checkpoint_whose_flags_name_one_pre_ln_stack_but_has_two_is_refused_with_the_fix(
        tmp_path):
    """Before the normalize-before flags kept fairseq's per-stack meaning, one of them made both
    stacks pre-LN. Such a checkpoint (here tests/data/pre_redesign, pre-LN in both, its options
    edited to name the encoder only) is refused with the --model-overrides that loads it, and
    then translates as before."""
    from fairseq import checkpoint_utils

    here = PRE_REDESIGN
    state = torch.load(os.path.join(here, "checkpoint.pt"), weights_only=False)
    state["cfg"]["model"].decoder_normalize_before = False
    torch.save(state, tmp_path / "one_flag.pt")
    overrides = PRE_REDESIGN_OVERRIDES
    with pytest.raises(PluginError, match=(
            "the checkpoint's decoder is pre-LN but these options build a post-LN decoder; "
            ".*load it with --model-overrides "
            "\"{'encoder_normalize_before': True, 'decoder_normalize_before': True}\"$")):
        checkpoint_utils.load_model_ensemble_and_task([str(tmp_path / "one_flag.pt")],
                                                      arg_overrides=overrides)
    models, _, _ = checkpoint_utils.load_model_ensemble_and_task(  # the fix it names
        [str(tmp_path / "one_flag.pt")],
        arg_overrides={**overrides, "encoder_normalize_before": True,
                       "decoder_normalize_before": True})
    expected = torch.load(os.path.join(here, "expected.pt"))
    with torch.no_grad():
        logits = models[0].eval()(expected["src_tokens"], expected["src_lengths"],
                                  expected["prev_output_tokens"])[0]
    real = expected["prev_output_tokens"].ne(1)  # padding is free
    assert (logits[real] - expected["logits"][real]).abs().max() <= 1e-5
    # not strict either: the other placement would compute something else
    pre_ln_encoder_only = build_tiny_model(decoder_normalize_before=True)
    with pytest.raises(PluginError, match="the checkpoint's encoder is pre-LN"):
        pre_ln_encoder_only.load_state_dict(build_tiny_model().state_dict(), strict=False)


def test_fused_attention_backends_reach_every_attention_from_the_flag_and_from_overrides(
        tmp_path):
    """--fused-attention-backends reaches both stacks from the command line, no-cudnn
    by default; a checkpoint saved before the option existed loads with that default, and
    --model-overrides changes it when it loads; another value gets argparse's one line."""
    from fairseq import checkpoint_utils, tasks

    from fairseq_plugin.modules.attention import NO_CUDNN, TORCH_CHOICE

    def backends(model):  # each stack's, around its layers (tests/test_attention.py)
        return [model.encoder.attention_backends, model.decoder.attention_backends]

    d = make_dictionary(40)
    for extra, expected in (([], NO_CUDNN), (["--fused-attention-backends", TORCH_CHOICE],
                                             TORCH_CHOICE)):
        args = tiny_training_args(tmp_path, d, *extra)
        model = tasks.setup_task(args).build_model(args)
        assert backends(model) == [expected] * 2
    exit_code(tiny_training_args, tmp_path, d, "--fused-attention-backends", "cudnn")

    for extra, expected in (({}, NO_CUDNN), ({"fused_attention_backends": TORCH_CHOICE},
                                             TORCH_CHOICE)):
        models, _, _ = checkpoint_utils.load_model_ensemble_and_task(
            [os.path.join(PRE_REDESIGN, "checkpoint.pt")],
            arg_overrides={**PRE_REDESIGN_OVERRIDES, **extra})
        assert set(backends(models[0])) == {expected}


def test_no_packing_runs_training_on_every_position_from_the_flag_and_old_checkpoints_pack(
        tmp_path):
    """--no-packing: both stacks' feed-forward sub-layers see every position of a padded
    training batch, as the model does without the flag only outside training; without it they
    see the real tokens only, and a checkpoint saved before the option existed packs."""
    from fairseq import checkpoint_utils, tasks

    d = make_dictionary(40)
    src = random_tokens(d, 4, 7)
    src[1, :4] = d.pad()
    tgt = random_tokens(d, 4, 6)
    tgt[3, 2:] = d.pad()
    real = (int(src.ne(d.pad()).sum()), int(tgt.ne(d.pad()).sum()))
    for extra, rows_expected in (([], real), (["--no-packing"], (src.numel(), tgt.numel()))):
        args = tiny_training_args(tmp_path, d, "--dropout", "0", *extra)
        model = tasks.setup_task(args).build_model(args).train()
        rows = []
        for layer in (model.encoder.layers[0], model.decoder.layers[0]):
            layer.feed_forward.register_forward_hook(
                lambda _, inputs, out: rows.append(inputs[0].shape[:-1].numel()))
        model(src, src.ne(d.pad()).sum(1), tgt)
        assert tuple(rows) == rows_expected, extra

    models, _, _ = checkpoint_utils.load_model_ensemble_and_task(
        [os.path.join(PRE_REDESIGN, "checkpoint.pt")], arg_overrides=PRE_REDESIGN_OVERRIDES)
    assert models[0].encoder.skip_padding and models[0].decoder.skip_padding


def test_a_longer_position_limit_loads_sinusoidal_checkpoints_and_refuses_learned_ones():
    """What --model-overrides "{'max_source_positions': N}" meets when the model loads."""
    d = make_dictionary()
    for learned in (False, True):
        trained = build_tiny_model(d, encoder_learned_pos=learned, max_source_positions=16)
        longer = build_tiny_model(d, encoder_learned_pos=learned, max_source_positions=32)
        if not learned:
            longer.load_state_dict(trained.state_dict())
            assert longer.encoder.max_positions() == 32
            continue
        with pytest.raises(PluginError, match=r"the checkpoint's encoder.embed.positional.embed."
                                              r"weight has shape \(16, 64\) but this model's has "
                                              r"\(32, 64\); it was trained with other sizes"):
            longer.load_state_dict(trained.state_dict())


# 0.99999 rounds to 1 in the CPU dropout mask of dropout and activation_dropout; attention's
# dropout is torch's (test below)
@pytest.mark.parametrize("flag, p", [
    (flag, p) for flag in ("dropout", "attention_dropout", "activation_dropout")
    for p in (1.0, -0.1, 0.99999) if (flag, p) != ("attention_dropout", 0.99999)])
def test_a_dropout_that_is_not_a_probability_is_a_clear_error(flag, p):
    with pytest.raises(PluginError, match=f"--{flag.replace('_', '-')} {p} is not a probability"):
        build_tiny_model(**{flag: p})
    build_tiny_model(**{flag: 0.9999})  # below 1 - 2^-16: allowed


def test_attention_dropout_is_torchs_and_takes_any_p_below_1():
    model = build_tiny_model(attention_dropout=0.99999)
    assert model.encoder.layers[0].self_attn.dropout.p == 0.99999


def test_too_long_source_is_a_clear_error():
    d = make_dictionary()
    model = build_tiny_model(d, max_source_positions=8)
    with pytest.raises(PluginError, match="source sentence has 9 tokens .* at most 8 "
                                          r"\(--max-source-positions\)"):
        model.encoder(random_tokens(d, 1, 9))


def test_a_batch_padded_past_the_position_limit_is_refused_only_for_a_longer_sentence():
    """fairseq pads batches (--required-seq-len-multiple, or a longer neighbour's padding): a
    batch wider than --max-source-positions whose sentences fit encodes as its rows alone."""
    d = make_dictionary()
    model = build_tiny_model(d, max_source_positions=10)
    tokens = random_tokens(d, 2, 10)
    padded = torch.cat([torch.full((2, 6), d.pad()), tokens], 1)  # left-padded to 16
    with torch.no_grad():
        encoded = model.encoder(padded)["encoder_out"][0][:, 6:]
        alone = model.encoder(tokens)["encoder_out"][0]
    assert torch.allclose(encoded, alone, atol=1e-5)
    padded[0, 5] = tokens[0, 0]  # now 11 tokens
    with pytest.raises(PluginError, match="source sentence has 11 tokens"):
        model.encoder(padded)


def test_the_position_limits_hold_without_positional_encodings():
    """As for fairseq's transformer: the flags bound the sentences (training filters, generation's
    max length) whether or not the model adds positional encodings."""
    model = build_tiny_model(no_token_positional_embeddings=True, max_source_positions=10,
                             max_target_positions=12)
    assert model.encoder.embed.positional is None
    assert model.max_positions() == (10, 12)
    with pytest.raises(PluginError, match=r"source sentence has 11 tokens .* at most 10 "):
        model.encoder(random_tokens(make_dictionary(), 1, 11))


def test_the_sinusoidal_table_is_the_papers_formula():
    """SinusoidalPositionalEncoding's table (the notebook's exp-log form, in fp32) against
    reference.positional_encoding (the formula of section 3.5 in float64) and a few values by
    hand: PE(pos, 0) = sin(pos), PE(pos, 1) = cos(pos), PE(pos, 62) = sin(pos / 10000^(62/64))."""
    table = SinusoidalPositionalEncoding(64, 300).table(torch.float32, torch.device("cpu"))
    expected = reference.positional_encoding(300, 64)
    assert table.shape == expected.shape == (300, 64)
    assert (table.double() - expected).abs().max() < 1e-4  # fp32 angles up to 299 radians
    for pos in (0, 1, 7, 299):
        assert math.isclose(table[pos, 0], math.sin(pos), abs_tol=1e-4)
        assert math.isclose(table[pos, 1], math.cos(pos), abs_tol=1e-4)
        assert math.isclose(table[pos, 62], math.sin(pos / 10000 ** (62 / 64)), abs_tol=1e-4)
        assert math.isclose(expected[pos, 63], math.cos(pos / 10000 ** (62 / 64)), abs_tol=1e-9)


def test_a_decoding_step_past_learned_target_positions_is_a_clear_error():
    d = make_dictionary()
    model = build_tiny_model(d, max_target_positions=8, decoder_learned_pos=True)
    src = random_tokens(d, 1, 4)
    prefix = torch.cat([torch.full((1, 1), d.eos()), random_tokens(d, 1, 8)], dim=1)  # 9 tokens
    state = {}
    with torch.no_grad():
        for t in range(1, 9):  # 8 tokens: allowed
            model.decoder(prefix[:, :t], model.encoder(src), incremental_state=state)
        with pytest.raises(PluginError, match="a target of 9 tokens is past this model's 8 "
                                              r"learned positions \(--max-target-positions\); "
                                              "beam search goes past them only under "
                                              "--match-source-len"):
            model.decoder(prefix, model.encoder(src), incremental_state=state)


def test_match_source_len_decodes_past_sinusoidal_target_positions_like_a_longer_limit():
    """fairseq's --match-source-len does not cap the length at --max-target-positions; fairseq's
    transformer then computes further sinusoids, and so does this model: its hypotheses are those
    of the same weights with a limit long enough."""
    from fairseq.sequence_generator import SequenceGenerator

    d = make_dictionary()
    limited = build_tiny_model(d, max_source_positions=16, max_target_positions=8)
    longer = build_tiny_model(d, max_source_positions=16, max_target_positions=64)
    longer.load_state_dict(limited.state_dict())
    src = random_tokens(d, 2, 12)
    src[:, -1] = d.eos()
    sample = {"net_input": {"src_tokens": src, "src_lengths": torch.full((2,), 12)}}
    hypotheses = []
    for model in (limited, longer):
        generator = SequenceGenerator([model], d, beam_size=2, match_source_len=True)
        hypotheses.append([[h["tokens"] for h in sentence]
                           for sentence in generator.generate([model], sample)])
    # as long as the 12-token source (fairseq 0.12.2: with its eos; fairseq-fixed: and one more)
    assert min(len(h) for sentence in hypotheses[0] for h in sentence) >= 12  # past 8
    assert all(torch.equal(a, b) for x, y in zip(*hypotheses) for a, b in zip(x, y))


def test_a_working_transformer_command_builds_and_trains_with_the_annotated_arch(tmp_path):
    """fairseq's IWSLT'14 example command with more model flags (values other than the defaults,
    so each must arrive), with only the --arch swapped: the same settings, and fairseq's task
    builds the model and criterion, which take a training step."""
    from fairseq import options, tasks

    command = ("DATA --arch {arch} --share-decoder-input-output-embed --optimizer adam "
               "--adam-betas (0.9,0.98) --clip-norm 0.0 --lr 5e-4 --lr-scheduler inverse_sqrt "
               "--warmup-updates 4000 --dropout 0.3 --weight-decay 0.0001 "
               "--criterion label_smoothed_cross_entropy --label-smoothing 0.1 --max-tokens 4096 "
               "--attention-dropout 0.2 --activation-dropout 0.1 --activation-fn gelu "
               "--encoder-layers 6 --decoder-layers 6 --encoder-embed-dim 512 "
               "--decoder-embed-dim 512 --encoder-ffn-embed-dim 1024 --decoder-ffn-embed-dim 1024 "
               "--encoder-attention-heads 4 --decoder-attention-heads 4 --encoder-learned-pos "
               "--decoder-learned-pos --encoder-normalize-before "
               "--max-source-positions 256 --max-target-positions 256 --no-scale-embedding "
               "--source-lang de --target-lang en "
               "--user-dir " + os.path.dirname(fairseq_plugin.__file__))
    d = make_dictionary(40)
    for lang in ("de", "en"):
        d.save(str(tmp_path / f"dict.{lang}.txt"))
    command = command.replace("DATA", str(tmp_path))
    parsed = {}
    for arch in ("transformer_iwslt_de_en", "annotated_transformer_iwslt_de_en"):
        parser = options.get_training_parser()
        parsed[arch] = options.parse_args_and_arch(parser, command.format(arch=arch).split())
    ours = parsed["annotated_transformer_iwslt_de_en"]
    for side in ("encoder", "decoder"):
        for name in ("layers", "embed_dim", "ffn_embed_dim", "attention_heads", "learned_pos",
                     "normalize_before"):
            name = f"{side}_{name}"
            assert getattr(ours, name) == getattr(parsed["transformer_iwslt_de_en"], name), name
    for name in ("dropout", "attention_dropout", "activation_dropout", "activation_fn",
                 "share_decoder_input_output_embed", "max_source_positions",
                 "max_target_positions", "no_scale_embedding"):
        assert getattr(ours, name) == getattr(parsed["transformer_iwslt_de_en"], name), name
    task = tasks.setup_task(ours)
    model, criterion = task.build_model(ours), task.build_criterion(ours)
    assert type(model).__name__ == "AnnotatedTransformerIwsltDeEnModel"
    # the model built follows them
    layer = model.decoder.layers[0]
    assert (len(model.encoder.layers), len(model.decoder.layers)) == (6, 6)
    assert layer.feed_forward.w_1.weight.shape == (1024, 512) and layer.self_attn.h == 4
    assert model.encoder.embed.positional.max_positions == 256
    assert type(model.decoder.embed.positional).__name__ == "LearnedPositionalEncoding"
    assert model.encoder.embed.embeddings.factor == 1.0  # --no-scale-embedding
    assert model.decoder.generator.proj.weight is model.decoder.embed.embeddings.lut.weight
    assert model.decoder.embed.dropout.p == layer.sublayer[0].dropout.p == 0.3  # --dropout
    assert layer.src_attn.dropout.p == 0.2 and layer.feed_forward.dropout.p == 0.1
    assert "gelu" in layer.feed_forward.activation.__name__
    # fairseq's meaning: pre-LN in the stack the flag names, post-LN in the other
    assert model.encoder.layers[0].sublayer[0].normalize_before and model.encoder.norm is not None
    assert not layer.sublayer[0].normalize_before and model.decoder.norm is None
    src, tgt = random_tokens(d, 4, 7), random_tokens(d, 4, 6)
    sample = {"net_input": {"src_tokens": src, "src_lengths": torch.full((4,), 7),
                            "prev_output_tokens": torch.roll(tgt, 1, 1)},
              "target": tgt, "ntokens": tgt.numel()}
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-4)
    model.train()
    losses = []
    for _ in range(3):
        loss, _, _ = criterion(model, sample)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    assert all(map(math.isfinite, losses)) and losses[-1] < losses[0]


def padded_targets(d, lengths, left_pad=False):
    """prev_output_tokens of the given lengths (eos first), padded right (as in training) or
    left (--left-pad-target)."""
    T = max(lengths)
    prev = torch.full((len(lengths), T), d.pad())
    for i, n in enumerate(lengths):
        seq = torch.cat([torch.tensor([d.eos()]), random_tokens(d, 1, n - 1)[0]])
        if left_pad:
            prev[i, T - n:] = seq
        else:
            prev[i, :n] = seq
    return prev


@pytest.mark.parametrize("training", [True, False], ids=["training", "evaluation"])
@pytest.mark.parametrize("left_pad", [False, True])
def test_each_sentence_of_a_padded_target_batch_gets_the_logits_it_gets_alone(left_pad, training):
    """In training the decoder skips padding in its position-wise work; in evaluation it does
    not; either way it hides left padding from self-attention: padding must change no real
    position's output."""
    d = make_dictionary()
    model = build_tiny_model(d, dropout=0.0).train(training)
    lengths = [6, 2, 4, 6]
    src = random_tokens(d, len(lengths), 5)
    prev = padded_targets(d, lengths, left_pad)
    with torch.no_grad():
        batch = model(src, torch.full((len(lengths),), 5), prev)[0]
        for i, n in enumerate(lengths):
            real = prev[i].ne(d.pad())
            alone = model(src[i:i + 1], torch.tensor([5]), prev[i:i + 1, real])[0][0]
            assert (batch[i, real] - alone).abs().max() <= 1e-5, i


@pytest.mark.parametrize("left_pad", [False, True])
def test_gradients_of_a_padded_batch_are_the_sum_over_its_sentences(left_pad):
    """Right padding (training) or left padding (--left-pad-target, whose padding queries see
    no key: zeros, not NaN, in the gradients on every torch)."""
    d = make_dictionary()
    model = build_tiny_model(d, dropout=0.0).train()
    lengths = [6, 3, 5]
    src = random_tokens(d, len(lengths), 5)
    src_lengths = torch.full((len(lengths),), 5)
    prev = padded_targets(d, lengths, left_pad)
    target = torch.where(prev.ne(d.pad()), random_tokens(d, *prev.shape), prev)

    def grads(loss):
        model.zero_grad()
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    def nll(logits, tgt):
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), tgt.reshape(-1), ignore_index=d.pad(),
            reduction="sum")

    batch = grads(nll(model(src, src_lengths, prev)[0], target))
    summed = None
    for i in range(len(lengths)):
        real = prev[i].ne(d.pad())
        g = grads(nll(model(src[i:i + 1], src_lengths[i:i + 1], prev[i:i + 1, real])[0],
                      target[i:i + 1, real]))
        summed = g if summed is None else {k: summed[k] + g[k] for k in g}
    for name in batch:
        assert torch.allclose(batch[name], summed[name], atol=1e-4, rtol=1e-4), name


@pytest.mark.parametrize("left_pad_target", [False, True])
def test_skipping_padding_changes_no_result(left_pad_target):
    """Packing (position-wise work on real tokens only, in training) is pure speed: the same
    logits at every real position and the same gradients as the plain model."""
    d = make_dictionary()
    model = build_tiny_model(d, dropout=0.0).train()
    src = random_tokens(d, 4, 7)
    src[1, :3] = d.pad()  # left-padded source, as fairseq-generate pads
    src[2, :6] = d.pad()
    tgt = random_tokens(d, 4, 6)
    if left_pad_target:
        tgt[0, :2] = d.pad()
    tgt[3, 2:] = d.pad()
    real = tgt.ne(d.pad())
    rows = []  # the positions the first feed-forward network of each stack works on
    for layer in (model.encoder.layers[0], model.decoder.layers[0]):
        layer.feed_forward.register_forward_hook(
            lambda _, args, out: rows.append(args[0].shape[:-1].numel()))
    results = []
    for skip in (True, False):
        model.encoder.skip_padding = model.decoder.skip_padding = skip
        model.zero_grad()
        rows.clear()
        logits = model(src, src.ne(d.pad()).sum(1), tgt)[0]
        (logits[real].float().pow(2).mean()).backward()
        results.append((logits[real].detach(), [p.grad.clone() for p in model.parameters()],
                        list(rows)))
    (packed, packed_grads, packed_rows), (plain, plain_grads, plain_rows) = results
    assert packed_rows == [int(src.ne(d.pad()).sum()), int(real.sum())]  # real tokens only
    assert plain_rows == [src.numel(), tgt.numel()]
    assert torch.allclose(packed, plain, atol=1e-5)
    for a, b in zip(packed_grads, plain_grads):
        assert torch.allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("post_norm", [False, True], ids=["pre-LN", "post-LN"])
def test_encoder_states_and_decoder_features_are_each_layers_output_packed_or_not(post_norm):
    """fairseq's model interface beyond the logits: the encoder's ``encoder_states``
    (return_all_hiddens=True), the embeddings then each layer's output; the decoder's features
    before the generator (features_only=True). In training with packing and without it alike."""
    from fairseq_plugin.modules.packing import NO_PACKING

    d = make_dictionary()
    model = build_tiny_model(d, dropout=0.0, post_norm=post_norm).train()
    src = random_tokens(d, 3, 7)
    src[1, :3] = d.pad()
    tgt = random_tokens(d, 3, 5)
    tgt[2, 3:] = d.pad()
    real_src, real_tgt = src.ne(d.pad()), tgt.ne(d.pad())
    encoder, decoder = model.encoder, model.decoder
    mask = real_src[:, None, None, :]
    d_model = encoder.embed.embeddings.lut.embedding_dim
    results = []
    for skip in (True, False):
        encoder.skip_padding = decoder.skip_padding = skip
        encoder_out = encoder(src, real_src.sum(1), return_all_hiddens=True)
        states = encoder_out["encoder_states"]
        assert len(states) == len(encoder.layers) + 1
        assert all(s.shape == (3, 7, d_model) for s in states)
        assert torch.allclose(states[0], encoder.embed(src))
        for layer, before, after in zip(encoder.layers, states, states[1:]):
            assert torch.allclose(layer(before, mask, NO_PACKING)[real_src], after[real_src],
                                  atol=1e-5)
        last = states[-1] if post_norm else encoder.norm(states[-1])
        assert torch.allclose(last[real_src], encoder_out["encoder_out"][0][real_src], atol=1e-6)
        features, extra = decoder(tgt, encoder_out, features_only=True)
        assert features.shape == (3, 5, d_model) and len(extra["inner_states"]) == 3  # 2 layers
        logits = decoder(tgt, encoder_out)[0]
        assert torch.allclose(decoder.output_layer(features), logits)
        results.append((torch.stack(states)[:, real_src], features[real_tgt]))
    (packed_states, packed_features), (plain_states, plain_features) = results
    assert torch.allclose(packed_states, plain_states, atol=1e-5)
    assert torch.allclose(packed_features, plain_features, atol=1e-5)


def test_an_explicit_alignment_layer_and_heads_give_that_layers_source_attention():
    """fairseq's alignment_layer / alignment_heads (e.g. a subclass supervising alignments):
    the source attention of that layer averaged over its first heads, in training too (where
    the decoder then does not pack)."""
    from fairseq_plugin.modules.attention import recording_attention

    d = make_dictionary()
    model = build_tiny_model(d, dropout=0.0)
    src, tgt = random_tokens(d, 2, 6), random_tokens(d, 2, 4)
    tgt[1, 2:] = d.pad()
    for training in (False, True):
        model.train(training)
        with recording_attention(model.decoder) as records:
            _, extra = model(src, torch.tensor([6, 6]), tgt, alignment_layer=0,
                             alignment_heads=1)
        first_head = records["layers.0.src_attn"][0][:, 0]  # (B, T, S)
        assert extra["attn"][0].shape == (2, 4, 6)
        assert torch.allclose(extra["attn"][0], first_head), training
        assert not torch.allclose(first_head, records["layers.1.src_attn"][0][:, 0])
        assert not torch.allclose(first_head, records["layers.0.src_attn"][0][:, 1])
        if training:  # every row as the decoder without packing gives it, padding rows too
            model.decoder.skip_padding = False
            _, plain = model(src, torch.tensor([6, 6]), tgt, alignment_layer=0, alignment_heads=1)
            model.decoder.skip_padding = True
            assert torch.allclose(extra["attn"][0], plain["attn"][0], atol=1e-6)


def test_a_batch_is_packed_only_where_enough_of_it_is_padding():
    """Packing pays for its copies only from MIN_PADDING_SHARE (2 %) of padded positions up."""
    from fairseq_plugin.modules.packing import NO_PACKING, RealPositions, packing_for

    padding = torch.zeros(10, 10, dtype=torch.bool)
    padding[0, :1] = True  # 1 %
    assert packing_for(padding, 1) is NO_PACKING
    padding[0, :2] = True  # 2 %
    packing = packing_for(padding, 2)
    assert isinstance(packing, RealPositions)
    assert torch.equal(packing.index, torch.arange(2, 100))
    assert packing_for(padding, 2, enabled=False) is NO_PACKING
    assert packing_for(None, 0) is NO_PACKING


@pytest.mark.parametrize("left_padded", [False, True], ids=["right-padded", "left-padded"])
def test_a_training_step_reads_the_device_once_per_stack(left_padded):
    """Each stack reads back from the device once per training forward, what it must know of the
    batch's padding at once (on a GPU each read waits for the work queued before it): the
    encoder whether to mask and pack its source, the decoder how much of its target is padding
    and whether a row is left-padded. Packing then finds the real positions without a read;
    backward reads nothing."""
    from fairseq_plugin.testing.operations import OperationCounter

    d = make_dictionary()
    model = build_tiny_model(d, dropout=0.0).train()
    src, tgt = random_tokens(d, 4, 7), random_tokens(d, 4, 6)
    src[1, :4] = d.pad()  # fairseq left-pads sources
    if left_padded:
        tgt[3, :2] = d.pad()
    else:
        tgt[3, 2:] = d.pad()
    with OperationCounter() as encoder:
        encoder_out = model.encoder(src)
    with OperationCounter() as decoder:
        logits, _ = model.decoder(tgt, encoder_out)
    with OperationCounter() as backward:
        logits.float().logsumexp(-1).sum().backward()
    assert (encoder.reads, decoder.reads, backward.reads) == (1, 1, 0)
    model.decoder.skip_padding = False  # at real tokens, the logits without packing
    model.encoder.skip_padding = False
    real = tgt.ne(d.pad())
    assert torch.allclose(model(src, None, tgt)[0][real], logits[real], atol=1e-5)


def test_packed_training_runs_the_layers_own_forward():
    """Skipping padding goes through the same modules' forward as the plain model: attention's
    hooks see every call while the feed-forward sub-layers see only the real rows."""
    from fairseq_plugin.modules.attention import recording_attention

    d = make_dictionary()
    model = build_tiny_model(d, dropout=0.0).train()
    src = random_tokens(d, 4, 7)
    src[1, :4] = d.pad()
    tgt = random_tokens(d, 4, 6)
    tgt[3, 2:] = d.pad()
    rows_seen = []
    for layer in (model.encoder.layers[0], model.decoder.layers[0]):
        layer.feed_forward.register_forward_hook(
            lambda _, args, out: rows_seen.append(tuple(args[0].shape[:-1])))
    with recording_attention(model) as records:
        model(src, src.ne(d.pad()).sum(1), tgt)
    assert rows_seen == [(int(src.ne(d.pad()).sum()),), (int(tgt.ne(d.pad()).sum()),)]
    assert len(records) == len(model.encoder.layers) + 2 * len(model.decoder.layers)
    for name, calls in records.items():
        T = 7 if name.startswith("encoder") else 6
        S = 6 if "self_attn" in name and name.startswith("decoder") else 7
        assert [w.shape for w in calls] == [(4, 4, T, S)], name


def test_unpacking_keeps_only_the_positions_for_backward_not_a_copy_of_the_rows():
    """Unpacking a projection (N, C) to (B, L, C) for attention keeps nothing of it for backward
    but the positions: attention keeps the unpacked tensor, and a second, packed copy per layer
    would cost memory (torch's index_copy keeps its whole source)."""
    from fairseq_plugin.modules.packing import RealPositions

    real = torch.tensor([[True, True, False], [True, False, False]])
    packing = RealPositions(real, 3)
    x = torch.randn(3, 5, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = packing.unpack(x)
    assert [t.dtype for t in saved] == [torch.int64]  # the positions
    assert torch.equal(out[real], x) and not out[~real].any()
    (out * torch.arange(30.0).view(2, 3, 5)).sum().backward()
    assert torch.equal(x.grad, torch.arange(30.0).view(6, 5)[real.reshape(-1)])


def kept_storages_for_backward(run) -> dict:
    """{storage address: bytes} of what autograd keeps for the backward of ``run()``."""
    kept = {}

    def keep(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        run()
    return kept


@pytest.mark.skipif(TORCH_RELEASE < (2, 5), reason="torch < 2.5's CPU kernel is the written-out "
                    "formula, which keeps its weights and returns its output in another layout")
@pytest.mark.parametrize("mask", ["causal", "padding", "padding, rows zeroed as on a GPU"])
def test_attention_keeps_its_input_projections_and_kernel_output_nothing_twice(monkeypatch, mask):
    """What attention keeps for backward in training: its input (the packed rows under packing),
    the projections the kernel reads (unpacked), and the kernel's output, which is also W^O's
    input (a view), not a copy of it packed or with rows zeroed. Where the fused kernel is not
    certain to zero a query with no key (on a GPU), the row becomes W^O's bias after W^O, and
    keeps nothing more; a fully padded source row is one here."""
    from fairseq_plugin.modules import attention as attention_module
    from fairseq_plugin.modules.attention import MultiHeadedAttention
    from fairseq_plugin.modules.packing import NO_PACKING, RealPositions

    if mask.endswith("GPU"):
        monkeypatch.setattr(attention_module, "fused_kernel_zeroes_empty_rows", lambda q: False)
    B, T, S, d = 4, 8, 6, 64
    real = torch.ones(B, T, dtype=torch.bool)
    real[1, 5:], real[3, 2:] = False, False  # right-padded targets
    self_attention = mask == "causal"
    attn = MultiHeadedAttention(4, d, self_attention=self_attention, causal=self_attention).train()
    memory, key_mask = torch.randn(B, S, d), torch.ones(B, 1, 1, S, dtype=torch.bool)
    key_mask[0, ..., 4:], key_mask[2] = False, False  # source 2: no key at all
    for packing, rows in ((RealPositions(real, int(real.sum())), int(real.sum())),
                          (NO_PACKING, B * T)):
        query = packing.pack(torch.randn(B, T, d)).requires_grad_()
        outputs = []
        kept = kept_storages_for_backward(lambda: outputs.append(
            attn(packing.rows(query))[0] if self_attention
            else attn(packing.rows(query), memory, mask=key_mask)[0]))
        parameters = {p.untyped_storage().data_ptr() for p in attn.parameters()}
        large = sum(n for ptr, n in kept.items()  # not masks, indices, statistics
                    if n >= B * d * 4 and ptr not in parameters)
        projections = 3 * B * T if self_attention else B * T + 3 * B * S  # Q K V / Q, memory, K V
        assert large == (rows + projections + B * T) * d * 4, (mask, rows)
        out = packing.unpack(outputs[0]) if packing is not NO_PACKING else outputs[0]
        if not self_attention:  # no key: W^O of a zero row, its bias
            assert torch.equal(out[2][real[2]], attn.out_proj.bias.expand(int(real[2].sum()), d))


def test_a_checkpoint_from_before_the_redesign_translates_identically():
    """tests/data/pre_redesign: a fairseq-train checkpoint (encoder width 32, decoder 24) and its
    outputs, written by the code before the readable-core redesign (commit ff85fd8)."""
    from fairseq import checkpoint_utils
    from fairseq.sequence_generator import SequenceGenerator

    here = PRE_REDESIGN
    models, _, task = checkpoint_utils.load_model_ensemble_and_task(
        [os.path.join(here, "checkpoint.pt")], arg_overrides=PRE_REDESIGN_OVERRIDES)
    model = models[0].eval()
    expected = torch.load(os.path.join(here, "expected.pt"))
    with torch.no_grad():
        logits = model(expected["src_tokens"], expected["src_lengths"],
                       expected["prev_output_tokens"])[0]
        sample = {"net_input": {"src_tokens": expected["src_tokens"],
                                "src_lengths": expected["src_lengths"]}}
        hyps = SequenceGenerator([model], task.target_dictionary, beam_size=5,
                                 max_len_b=20).generate([model], sample)
    real = expected["prev_output_tokens"].ne(task.target_dictionary.pad())  # padding is free
    assert (logits[real] - expected["logits"][real]).abs().max() <= 1e-5
    for got, tokens, scores in zip(hyps, expected["hypotheses"], expected["scores"]):
        assert [h["tokens"].tolist() for h in got] == [t.tolist() for t in tokens]
        assert all(abs(float(h["score"]) - s) <= 1e-4 for h, s in zip(got, scores))


@pytest.mark.parametrize("linear_init", [None, "fairseq", "glorot"])
def test_linear_maps_start_as_fairseqs_transformer_draws_them_or_as_the_notebook_does(
        linear_init):
    """--linear-init fairseq (the default, None): W^Q, W^K, W^V Glorot uniform with gain
    1/sqrt(2), W^O's bias 0, the feed-forward torch's nn.Linear default U(+-1/sqrt(fan_in));
    glorot: W^Q, W^K, W^V, W^O and the feed-forward's W_1, W_2 each Glorot uniform on its own,
    the notebook's make_model. Each matrix's largest entry lies just under its own bound (4,096
    or more draws each)."""
    model = build_tiny_model(linear_init=linear_init)
    fairseq = linear_init != "glorot"

    def drawn_up_to(matrix, bound):
        largest = matrix.abs().max().item()
        assert 0.95 * bound < largest <= bound, (tuple(matrix.shape), largest, bound)

    def glorot(matrix, gain=1.0):
        return gain * math.sqrt(6.0 / sum(matrix.shape))

    layers = [*model.encoder.layers, *model.decoder.layers]
    attentions = [a for layer in layers for a in (layer.self_attn, getattr(layer, "src_attn", None))
                  if a is not None]
    assert len(attentions) == 6
    for attention in attentions:
        projections = ((attention.qkv_proj,) if attention.self_attention
                       else (attention.q_proj, attention.kv_proj))
        for proj in projections:
            for matrix in proj.weight.detach().split(64, dim=0):  # W^Q, W^K, W^V: 64 x 64 each
                drawn_up_to(matrix, glorot(matrix, 2 ** -0.5 if fairseq else 1.0))
        drawn_up_to(attention.out_proj.weight, glorot(attention.out_proj.weight))
        assert attention.out_proj.bias.any() != fairseq
    for layer in layers:
        for linear in (layer.feed_forward.w_1, layer.feed_forward.w_2):  # 64 -> 256 -> 64
            bound = linear.in_features ** -0.5 if fairseq else glorot(linear.weight)
            drawn_up_to(linear.weight, bound)


@pytest.mark.parametrize("shared", [True, False])
def test_token_embeddings_start_at_the_positional_encodings_size_unless_glorot_is_asked_for(
        shared):
    """--embedding-init normal (the default): token embeddings and an output projection of their
    own from N(0, d_model^-0.5), as fairseq's transformer, so that scaled by sqrt(d_model) they
    start with a standard deviation of 1, the positional encodings' size; glorot: the notebook's
    make_model, Glorot uniform like every other matrix. Padding rows start at zero either way."""
    sharing = {"share_all_embeddings": shared}
    d_model, padding = 64, make_dictionary().pad()
    normal = build_tiny_model(**sharing)
    glorot = build_tiny_model(embedding_init="glorot", **sharing)
    for model, expected_std in ((normal, d_model ** -0.5), (glorot, None)):
        weights = [model.encoder.embed.embeddings.lut.weight,
                   model.decoder.embed.embeddings.lut.weight, model.decoder.generator.proj.weight]
        assert (weights[0] is weights[2]) == shared
        for weight in weights:
            rows, cols = weight.shape
            if expected_std is None:  # Glorot uniform's bound for a rows x cols matrix
                assert weight.abs().max() <= math.sqrt(6.0 / (rows + cols))
            else:
                real = torch.cat([weight[:padding], weight[padding + 1:]])
                assert abs(real.std().item() - expected_std) < 0.15 * expected_std
        for lut in weights[:2]:
            assert not lut[padding].any()
