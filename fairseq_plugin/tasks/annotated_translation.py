"""fairseq's translation task with chrF beside BLEU in validation.

fairseq-train --eval-bleu decodes the validation set with beam search after each epoch and logs
its BLEU, so that --best-checkpoint-metric bleu chooses checkpoints by it. chrF (Popović 2015),
the character n-gram F-score that sacreBLEU computes beside BLEU, is logged the same way here:

  fairseq-train DATA_BIN --user-dir fairseq_plugin --task annotated_translation --eval-chrf \\
      --eval-bleu-args '{"beam": 5}' --eval-bleu-detok moses --eval-bleu-remove-bpe \\
      --best-checkpoint-metric chrf --maximize-best-checkpoint-metric ...

The hypotheses are made as --eval-bleu makes them, with its flags (--eval-bleu-args,
--eval-bleu-detok, --eval-bleu-detok-args, --eval-bleu-remove-bpe, --eval-bleu-print-samples);
with --eval-bleu as well, one beam search serves both scores. Each batch logs chrF's sufficient
statistics (character n-gram matches and counts), which fairseq sums over batches and workers
before the score is computed from them: the corpus chrF of the whole validation set, as
sacreBLEU's corpus score, not a mean of batch scores.
"""

import json
import logging
from argparse import Namespace
from dataclasses import dataclass, field
from typing import List, Tuple

from fairseq import utils
from fairseq.data import encoders
from fairseq.logging import metrics
from fairseq.tasks import FairseqTask, register_task
from fairseq.tasks.translation import EVAL_BLEU_ORDER, TranslationConfig, TranslationTask

logger = logging.getLogger(__name__)

# private-use characters: they share no character with each other or with any text
UNKNOWN_IN_HYPOTHESIS, UNKNOWN_IN_REFERENCE = "\ue000", "\ue001"


def chrf_metric():
    """sacreBLEU's chrF with its defaults (chrF2: character 6-grams, recall weighted by beta 2),
    the score annotated-evaluate-bleu prints with its signature."""
    import sacrebleu

    return sacrebleu.metrics.CHRF()


def chrf_statistics(hypotheses: List[str], references: List[str]) -> List[int]:
    """chrF's sufficient statistics of a batch, summed over its sentences (a list of
    3 x n-gram orders numbers: for each order, hypothesis n-grams, reference n-grams, matches);
    zeros for an empty batch, so that every worker logs the same keys."""
    metric = chrf_metric()
    per_sentence = metric._extract_corpus_statistics(hypotheses, [references])
    return [sum(column) for column in zip(*per_sentence)] or [0] * n_statistics(metric)


def n_statistics(metric) -> int:
    return 3 * (metric.char_order + metric.word_order)


def chrf_from_statistics(totals: List[float]) -> float:
    """The corpus chrF from statistics summed over all sentences."""
    return chrf_metric()._compute_score_from_stats([int(t) for t in totals]).score


@dataclass
class AnnotatedTranslationConfig(TranslationConfig):
    eval_chrf: bool = field(default=False, metadata={
        "help": "evaluation with chrF scores (logged as chrf; --best-checkpoint-metric chrf "
                "--maximize-best-checkpoint-metric selects by it); generation and "
                "detokenisation follow the --eval-bleu-* options: on BPE and Moses-tokenised "
                "data give --eval-bleu-remove-bpe and --eval-bleu-detok moses, or chrF counts "
                "the markup's characters"})


@register_task("annotated_translation", dataclass=AnnotatedTranslationConfig)
class AnnotatedTranslationTask(TranslationTask):
    """fairseq's ``translation`` task, plus ``--eval-chrf``."""

    def build_model(self, cfg, from_checkpoint=False):
        model = super().build_model(cfg, from_checkpoint)
        if self.cfg.eval_chrf and not self.cfg.eval_bleu:  # (--eval-bleu has made them)
            self.tokenizer = encoders.build_tokenizer(Namespace(
                tokenizer=self.cfg.eval_bleu_detok, **json.loads(self.cfg.eval_bleu_detok_args)))
            self.sequence_generator = self.build_generator(
                [model], Namespace(**json.loads(self.cfg.eval_bleu_args)))
        return model

    def valid_step(self, sample, model, criterion):
        if not self.cfg.eval_chrf:
            return super().valid_step(sample, model, criterion)
        # the validation loss, as every task computes it; TranslationTask's own beam search for
        # BLEU is skipped: BLEU comes below from the same hypotheses
        loss, sample_size, logging_output = FairseqTask.valid_step(self, sample, model, criterion)
        hypotheses, references = self.translate(sample, model)
        for i, total in enumerate(chrf_statistics(hypotheses, references)):
            logging_output[f"_chrf_stat_{i}"] = total
        if self.cfg.eval_bleu:  # under --eval-bleu's keys, which TranslationTask sums and scores
            import sacrebleu

            bleu = sacrebleu.corpus_bleu(hypotheses, [references],
                                         tokenize="none" if self.cfg.eval_tokenized_bleu else "13a")
            logging_output["_bleu_sys_len"], logging_output["_bleu_ref_len"] = (bleu.sys_len,
                                                                                bleu.ref_len)
            for n in range(EVAL_BLEU_ORDER):  # fairseq's --eval-bleu keys
                logging_output[f"_bleu_counts_{n}"] = bleu.counts[n]
                logging_output[f"_bleu_totals_{n}"] = bleu.totals[n]
        return loss, sample_size, logging_output

    def translate(self, sample, model) -> Tuple[List[str], List[str]]:
        """Beam search over the batch: (best hypotheses, references), each as text with the BPE
        removed and detokenised, in the batch's order. An unknown word is written as a different
        single character on each side, so that it never counts as a match, neither as a word
        (BLEU; the idea of fairseq's --eval-bleu) nor in character n-grams (chrF)."""
        def text(tokens, unknown):
            line = self.tgt_dict.string(tokens.int().cpu(), self.cfg.eval_bleu_remove_bpe,
                                        unk_string=unknown)
            return self.tokenizer.decode(line) if self.tokenizer else line

        found = self.inference_step(self.sequence_generator, [model], sample, prefix_tokens=None)
        hypotheses = [text(beams[0]["tokens"], UNKNOWN_IN_HYPOTHESIS) for beams in found]
        references = [text(utils.strip_pad(target, self.tgt_dict.pad()), UNKNOWN_IN_REFERENCE)
                      for target in sample["target"]]
        if self.cfg.eval_bleu_print_samples:
            logger.info(f"example hypothesis: {hypotheses[0]}")
            logger.info(f"example reference: {references[0]}")
        return hypotheses, references

    def reduce_metrics(self, logging_outputs, criterion):
        super().reduce_metrics(logging_outputs, criterion)
        if not self.cfg.eval_chrf:
            return
        n_stats = n_statistics(chrf_metric())
        totals = [sum(log.get(f"_chrf_stat_{i}", 0) for log in logging_outputs)
                  for i in range(n_stats)]
        if not any(totals):  # training's outputs, or no validation batch
            return
        for i, total in enumerate(totals):
            metrics.log_scalar_sum(f"_chrf_stat_{i}", int(total))
        metrics.log_derived("chrf", lambda meters: round(chrf_from_statistics(
            [meters[f"_chrf_stat_{i}"].sum for i in range(n_stats)]), 2))
