"""annotated-benchmark-deployment (fairseq_plugin/cli/deployment.py): fairseq against CTranslate2
fp32 and int8 on the same sentences, on test_translation_pipeline's small Tatoeba model."""

import statistics

import pytest
import sacrebleu

from conftest import cli, exit_code
from fairseq_plugin.cli import deployment
from fairseq_plugin.cli import evaluate as evaluate_bleu

pytest.importorskip("ctranslate2")


def table_rows(out):
    """{engine: its cells} of the printed table."""
    return {cells[0]: cells[1:] for cells in (line.strip("| ").split(" | ")
                                              for line in out.splitlines())
            if cells[0] in deployment.ENGINES}


def test_each_engine_translates_the_test_set_and_fairseqs_translations_are_fairseq_generates(
        trained, tmp_path):
    w, ckpt = trained
    out = cli("annotated-benchmark-deployment", w / "bin", ckpt / "checkpoint_last.pt",
              "--rounds", "1", "--threads", "1", "--batch-size", "16", "--work-dir",
              tmp_path).stdout
    hyps, _ = evaluate_bleu.generate_detokenised(str(w / "bin"), str(ckpt / "checkpoint_last.pt"))
    assert (tmp_path / "fairseq.test.en").read_text().splitlines() == [hyps[i] for i in range(60)]
    rows = table_rows(out)
    assert sorted(rows) == sorted(deployment.ENGINES), out
    for engine, (bleu, chrf, speed, memory) in rows.items():
        assert float(speed) > 0 and float(memory) > 0, engine
        assert len((tmp_path / f"{engine.replace(' ', '-')}.test.en").read_text()
                   .splitlines()) == 60
    assert "signature: nrefs:1|case:mixed|eff:yes|nc:6" in out  # chrF's, beside BLEU's


@pytest.mark.main_lane  # the command's own arithmetic, whatever fairseq's version
def test_the_runs_alternate_and_each_cell_is_the_median_of_its_rounds_and_each_score_its_own(
        trained, tmp_path, monkeypatch, capsys):
    """The child processes replaced by a stand-in: each engine's hypotheses its own (the
    reference of sentence i, with i words dropped for CTranslate2 int8), each run's time its
    place in the sequence of runs."""
    w, ckpt = trained
    refs = (w / "bin" / "raw" / "test.en").read_text().splitlines()
    calls = []

    def child(work, engine, threads, batches, **_):
        calls.append((engine, threads))
        _, order = deployment.test_batches(str(w / "bin"), {"source_lang": "de",
                                                            "target_lang": "en"}, 16)
        assert [len(b) for b in batches] == [16, 16, 16, 12]  # the same batches for every run
        drop = engine == "CTranslate2 int8"
        hypotheses = [refs[i].split()[:len(refs[i].split()) - (i % 3 if drop else 0)]
                      for i in order]
        return {"seconds": len(calls), "hypotheses": hypotheses, "memory_mb": 10 * len(calls)}

    monkeypatch.setattr(deployment, "run_child", child)
    deployment.main([str(w / "bin"), str(ckpt / "checkpoint_last.pt"), "--rounds", "3",
                     "--threads", "1,2", "--batch-size", "16", "--work-dir", str(tmp_path)])
    out = capsys.readouterr().out
    first = [(e, t) for t in (1, 2) for e in deployment.ENGINES]
    assert calls == first + first[::-1] + first  # every other round reversed
    rows = table_rows(out)
    for engine, (bleu, chrf, one, two, memory) in rows.items():
        for threads, cell in ((1, one), (2, two)):
            times = [n + 1 for n, call in enumerate(calls) if call == (engine, threads)]
            assert float(cell) == round(statistics.median(60 / t for t in times), 1)
        assert float(memory) == 10 * max(n + 1 for n, (e, _) in enumerate(calls) if e == engine)
        mine = (tmp_path / f"{engine.replace(' ', '-')}.test.en").read_text().splitlines()
        assert float(bleu) == round(sacrebleu.corpus_bleu(mine, [refs]).score, 2)
        assert float(chrf) == round(sacrebleu.corpus_chrf(mine, [refs]).score, 2)
    assert float(rows["fairseq"][0]) == 100.0 > float(rows["CTranslate2 int8"][0])


def test_bad_options_are_one_line_before_any_work(tmp_path, capsys):
    """In this process (the command's start-up paid once): its exit and its last line."""
    stop = exit_code(deployment.main, [str(tmp_path), str(tmp_path / "missing.pt")])
    assert stop == f"annotated-benchmark-deployment: error: {tmp_path} has no " \
        "prepare.json: give a data-bin made by annotated-prepare (it records the languages, " \
        "BPE codes and raw text)"
    stop = exit_code(deployment.main, [str(tmp_path), "x.pt", "--threads", "0"])
    assert stop == 2 and capsys.readouterr().err.splitlines()[-1].endswith(
        "argument --threads: '0': give whole numbers of at least 1, separated by commas, e.g. 1,2")
    assert list(tmp_path.iterdir()) == []
