"""``ingest build`` reads each evaluation file once, composing or not (no engine: every prompt held out)."""

from __future__ import annotations

import json

from eaglenest.ingest import pool as pool_module
from eaglenest.ingest.cli import main as ingest_main


def test_ingest_build_reads_each_evaluation_file_once(tmp_path, root, tiny_target, monkeypatch):
    # Composing leaves the evaluation prompts out of its documents and the contamination check drops their
    # twins: both read the files, which are downloads of thousands of prompts (and could change between reads).
    evals = tmp_path / "eval files" / "question.jsonl"
    evals.parent.mkdir()
    evals.write_text(json.dumps({"turns": ["What is the capital of France?"]}) + "\n")
    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"Question number {i}?"}) + "\n" for i in range(3)))
    mpath = tmp_path / "m.yaml"
    mpath.write_text(f"name: t\nlicence: x\nheld_out_count: 50\ngeneration: {{max_tokens: 4}}\n"
                     f"contamination:\n  mt_bench: ['{evals}']\n"
                     f"domains:\n  plain:\n    cap_prompts: 10\n    sources: [{{path: '{src}', provenance: p}}]\n"
                     f"  docs:\n    cap_prompts: 10\n    sources: []\n"
                     f"    compose: {{rule: documents, kinds: [records], target_tokens: [512], answer_tokens: 8}}\n")
    reads = []
    real = pool_module.load_eval_prompts

    def counted(path, *, where):  # the real reader, counted
        reads.append(str(path))
        return real(path, where=where)

    monkeypatch.setattr(pool_module, "load_eval_prompts", counted)
    work = tmp_path / "work"
    assert ingest_main(["build", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"--manifest={mpath}",
                        f"run.workdir={work}", f"run.target={tiny_target}"]) == 0
    stats = json.loads((work / "ingest" / "stats.json").read_text())
    assert stats["heldout_written"] == stats["pool_size"] == 4 and stats["contamination"]["eval_prompts"] == 1
    assert reads == [str(evals)]
