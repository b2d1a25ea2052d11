"""evaluation.py (`report.py evaluate`): task files, the seeded subsample, lm-eval's scores, the outputs."""

import json
import random
import sys

import pytest
import torch

import data
import evaluation
import model_config
import report
from common import UserError

WORDS = ["the cat", "a dog", "sat on", "the mat", "ran far", "in the park", "blue sky", "green tree", "one two"]


def choice_item(rng: random.Random) -> dict:
    context = " ".join(rng.sample(WORDS, 3))
    choices = [" ".join(rng.sample(WORDS, rng.randint(1, 3))) for _ in range(rng.randint(2, 4))]
    return {"context": context, "choices": choices, "answer": rng.randrange(len(choices))}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(model folder, items file, items): a tiny Qwen3 model (seeded init, a few steps) exported with report.py."""
    rng = random.Random(5)
    items = [choice_item(rng) for _ in range(24)]
    root = tmp_path_factory.mktemp("evaluation")
    tokenizer, _ = data.train_tokenizer([" ".join(WORDS)] * 20, 300, root / "tokenizer")
    torch.manual_seed(0)
    model = model_config.build_model(model_config.PRESETS["tiny"], len(tokenizer)).eval()
    report.export_hf_model(model, tokenizer, root / "run" / "model", {"status": "COMPLETE"})
    (root / "run" / "run_status.json").write_text(json.dumps({"status": "COMPLETE"}))
    items_file = root / "words.jsonl"
    items_file.write_text("".join(json.dumps(item) + "\n" for item in items))
    return root / "run" / "model", items_file, items


def hand_scores(model_dir, items) -> dict:
    """acc and acc_norm computed here: the summed log-probability of ' ' + choice after the context."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    right = right_norm = 0
    for item in items:
        context_ids = tokenizer(item["context"])["input_ids"]
        totals = []
        for choice in item["choices"]:
            ids = tokenizer(item["context"] + " " + choice)["input_ids"]
            with torch.no_grad():
                logprobs = torch.log_softmax(model(torch.tensor([ids[:-1]])).logits[0].double(), dim=-1)
            totals.append(sum(logprobs[position - 1, ids[position]].item()
                              for position in range(len(context_ids), len(ids))))
        right += max(range(len(totals)), key=totals.__getitem__) == item["answer"]
        norm = [total / len(choice) for total, choice in zip(totals, item["choices"])]
        right_norm += max(range(len(norm)), key=norm.__getitem__) == item["answer"]
    return {"acc": right / len(items), "acc_norm": right_norm / len(items)}


def test_seeded_subsample_is_fixed_by_the_seed():
    assert evaluation.seeded_subsample(10, None) is None
    assert evaluation.seeded_subsample(10, 10) is None and evaluation.seeded_subsample(10, 50) is None
    pick = evaluation.seeded_subsample(100, 7, seed=3)
    assert pick == sorted(pick) and len(set(pick)) == 7 and all(0 <= index < 100 for index in pick)
    assert evaluation.seeded_subsample(100, 7, seed=3) == pick != evaluation.seeded_subsample(100, 7, seed=4)
    with pytest.raises(UserError, match="--limit 0"):
        evaluation.seeded_subsample(10, 0)


def test_tasks_resolve_to_files_folders_and_names(tmp_path):
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "sums.jsonl").write_text('{"prompt": "What is 1 plus 2?", "answer": "3"}\n')
    (tmp_path / "eval" / "my-words.jsonl").write_text('\n{"context": "a", "choices": ["b", "c"], "answer": 1}\n')
    tasks = evaluation.resolve_tasks([str(tmp_path / "eval"), "hellaswag,arc_easy"])
    assert [(task["name"], task["kind"]) for task in tasks] == [
        ("local_my_words", "choice"), ("sums", "exact"), ("hellaswag", "lm_eval"), ("arc_easy", "lm_eval")]
    with pytest.raises(UserError, match="no such task file"):
        evaluation.resolve_tasks([str(tmp_path / "missing.jsonl")])
    (tmp_path / "odd.jsonl").write_text('{"question": "?"}\n')
    with pytest.raises(UserError, match="odd.jsonl: neither a multiple-choice file"):
        evaluation.resolve_tasks([str(tmp_path / "odd.jsonl")])


@pytest.mark.parametrize("line", ['{"context": "a", "choices": ["b"], "answer": 0}',
                                  '{"context": "a", "choices": ["b", "c"], "answer": 2}',
                                  '{"context": "a", "choices": ["b", ""], "answer": 0}',
                                  '{"context": 1, "choices": ["b", "c"], "answer": 0}', "{not json"])
def test_bad_choice_items_name_the_line(tmp_path, line):
    path = tmp_path / "items.jsonl"
    path.write_text('{"context": "a", "choices": ["b", "c"], "answer": 0}\n' + line + "\n")
    with pytest.raises(UserError, match=r"items.jsonl:2: "):
        evaluation.read_choice_items(path)


def test_a_missing_lm_eval_is_one_error_line_with_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    with pytest.raises(UserError, match=r"\(lm_eval is not installed\): pip install 'lm-eval>=0\.4\.13,<0\.5'"):
        evaluation.require_lm_eval()


def test_the_card_section_is_replaced_not_repeated():
    result = {"time": "now", "harness": {"num_fewshot": 0, "limit": None},
              "tasks": {"t": {"kind": "choice", "n": 3, "acc": 0.5, "acc_norm": 0.25}}}
    card = "# m\n\n## Evaluation\n\n- Test loss\n\n## How to use\n\ncode\n"
    once = evaluation.add_to_card(card, result)
    assert once.index("## Benchmark scores") < once.index("## How to use")
    assert "| t | choice | 3 | 0.5000 | 0.2500 | - |" in once and "num_fewshot 0" in once
    result["tasks"]["t"]["acc"] = 0.75
    twice = evaluation.add_to_card(once, result)
    assert twice.count("## Benchmark scores") == 1 and "| 0.7500 |" in twice and "| 0.5000 |" not in twice
    assert twice.endswith("## How to use\n\ncode\n")


@pytest.mark.slow
def test_evaluate_gives_lm_evals_own_numbers_and_the_hand_computed_ones(exported, tmp_path, capsys):
    import lm_eval
    from lm_eval.tasks import TaskManager

    model_dir, items_file, items = exported
    out = tmp_path / "scores.json"
    assert report.main(["evaluate", str(model_dir.parent), "--tasks", str(items_file), "--json", str(out),
                        "--batch-size", "4"]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    ours = result["tasks"]["local_words"]
    assert ours["n"] == len(items) and ours["kind"] == "choice"
    assert "| local_words | choice | 24 |" in printed

    # lm_eval run directly, on a task YAML written here, loading the model by its folder
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "direct.yaml").write_text(
        f"task: direct\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {items_file}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{context}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n"
        "  - metric: acc_norm\n")
    direct = lm_eval.simple_evaluate(model="hf", model_args={"pretrained": str(model_dir)}, tasks=["direct"],
                                     device="cpu",
                                     task_manager=TaskManager(include_path=str(tmp_path / "tasks"),
                                                              include_defaults=False))["results"]["direct"]
    expected = hand_scores(model_dir, items)
    for metric in ("acc", "acc_norm"):
        assert ours[metric] == pytest.approx(direct[f"{metric},none"], abs=1e-4)
        assert ours[metric] == pytest.approx(expected[metric], abs=1e-4)
    assert expected["acc"] != expected["acc_norm"]  # the items tell the two apart

    # the outputs: RUN/eval/, the model card with the settings, run_status.json's hash of the card kept true
    saved = json.loads((model_dir.parent / "eval" / "local_words.json").read_text())
    assert saved["scores"] == ours and saved["harness"]["lm_eval_version"] == lm_eval.__version__
    card = (model_dir / "README.md").read_text()
    assert f"| local_words | choice | 24 | {ours['acc']:.4f} | {ours['acc_norm']:.4f} |" in card
    assert "num_fewshot 0" in card and "do not compare" in card

    # --limit: a seeded subsample, scored on exactly those items
    assert report.main(["evaluate", str(model_dir), "--tasks", str(items_file), "--limit", "10",
                        "--json", str(out)]) == 0
    limited = json.loads(out.read_text())["tasks"]["local_words"]
    pick = evaluation.seeded_subsample(len(items), 10)
    assert limited["n"] == 10
    assert limited["acc"] == pytest.approx(hand_scores(model_dir, [items[i] for i in pick])["acc"], abs=1e-4)
    with pytest.raises(UserError, match="no_such_task"):
        report.main(["evaluate", str(model_dir), "--tasks", "no_such_task"])
