"""evaluation.py (`report.py evaluate`): task files, the seeded subsample, lm-eval's scores, the outputs."""

import json
import random
import sys
from pathlib import Path

import pytest
import torch

from tinyllm import common
from tinyllm.common import UserError
from tinyllm.data import build as data
from tinyllm.model import config as model_config
from tinyllm.model import losses
from tinyllm.outputs import evaluation, export_hf, report

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
    export_hf.export_hf_model(model, tokenizer, root / "run" / "model", {"status": "COMPLETE"})
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
            totals.append(
                sum(logprobs[position - 1, ids[position]].item() for position in range(len(context_ids), len(ids)))
            )
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
        ("local_my_words", "choice"),
        ("sums", "exact"),
        ("hellaswag", "lm_eval"),
        ("arc_easy", "lm_eval"),
    ]
    with pytest.raises(UserError, match="no such task file"):
        evaluation.resolve_tasks([str(tmp_path / "missing.jsonl")])
    (tmp_path / "odd.jsonl").write_text('{"question": "?"}\n')
    with pytest.raises(UserError, match="odd.jsonl: neither a multiple-choice file"):
        evaluation.resolve_tasks([str(tmp_path / "odd.jsonl")])


@pytest.mark.parametrize(
    "line",
    [
        '{"context": "a", "choices": ["b"], "answer": 0}',
        '{"context": "a", "choices": ["b", "c"], "answer": 2}',
        '{"context": "a", "choices": ["b", ""], "answer": 0}',
        '{"context": 1, "choices": ["b", "c"], "answer": 0}',
        "{not json",
    ],
)
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
    result = {
        "time": "now",
        "harness": {"num_fewshot": 0, "limit": None},
        "tasks": {"t": {"kind": "choice", "n": 3, "acc": 0.5, "acc_norm": 0.25}},
    }
    card = "# m\n\n## Evaluation\n\n- Test loss\n\n## How to use\n\ncode\n"
    once = export_hf.add_to_card(card, result)
    assert once.index("## Benchmark scores") < once.index("## How to use")
    assert "| t | choice | 3 | 0.5000 | 0.2500 | - |" in once and "num_fewshot 0" in once
    result["tasks"]["t"]["acc"] = 0.75
    twice = export_hf.add_to_card(once, result)
    assert twice.count("## Benchmark scores") == 1 and "| 0.7500 |" in twice and "| 0.5000 |" not in twice
    assert twice.endswith("## How to use\n\ncode\n")


@pytest.mark.slow
def test_evaluate_gives_lm_evals_own_numbers_and_the_hand_computed_ones(exported, tmp_path, capsys):
    import lm_eval
    from lm_eval.tasks import TaskManager

    model_dir, items_file, items = exported
    out = tmp_path / "scores.json"
    assert (
        report.main(
            ["evaluate", str(model_dir.parent), "--tasks", str(items_file), "--json", str(out), "--batch-size", "4"]
        )
        == 0
    )
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
        "  - metric: acc_norm\n"
    )
    direct = lm_eval.simple_evaluate(
        model="hf",
        model_args={"pretrained": str(model_dir)},
        tasks=["direct"],
        device="cpu",
        task_manager=TaskManager(include_path=str(tmp_path / "tasks"), include_defaults=False),
    )["results"]["direct"]
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
    assert (
        report.main(["evaluate", str(model_dir), "--tasks", str(items_file), "--limit", "10", "--json", str(out)]) == 0
    )
    limited = json.loads(out.read_text())["tasks"]["local_words"]
    pick = evaluation.seeded_subsample(len(items), 10)
    assert limited["n"] == 10
    assert limited["acc"] == pytest.approx(hand_scores(model_dir, [items[i] for i in pick])["acc"], abs=1e-4)
    with pytest.raises(UserError, match="no_such_task"):
        report.main(["evaluate", str(model_dir), "--tasks", "no_such_task"])


def test_report_evaluate_off_a_terminal_prints_no_library_noise(exported, tmp_path, monkeypatch, capfd):
    """A log file gets the table and the files written, not lm-eval's request bars (it passes tqdm disable=False
    itself), its few-shot warning, or git's 'fatal: not a git repository' from outside a repository."""
    model_dir, items_file, _ = exported
    monkeypatch.chdir(tmp_path)  # no git repository here
    for name, value in common.LIBRARY_PROGRESS_OFF.items():  # as run_main sets them where stderr is not a terminal
        monkeypatch.setenv(name, value)
    capfd.readouterr()
    assert report.main(["evaluate", str(model_dir), "--tasks", str(items_file), "--limit", "4"]) == 0
    printed = capfd.readouterr()
    assert "| local_words | choice | 4 |" in printed.out
    for noise in ("fatal:", "Running loglikelihood requests", "Tokenizing inputs", "Overwriting default num_fewshot"):
        assert noise not in printed.err, printed.err


# ----------------------------------------------------------------------------------------------
# In the loop (train.py --eval-tasks): the same conventions scored on the model itself.


def loop_log_likelihoods(model_dir, items, token_budget: int) -> list[float]:
    """evaluation.choice_rows + losses.continuation_log_likelihoods on an exported model, as train.py scores."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    rows = evaluation.choice_rows(
        items,
        lambda text: tokenizer.encode(text, add_special_tokens=False),
        tokenizer.bos_token_id,
        model.config.max_position_embeddings,
    )
    return losses.continuation_log_likelihoods(model, rows, torch.device("cpu"), token_budget)


@pytest.mark.slow
def test_the_loops_log_likelihoods_and_scores_are_lm_evals(exported):
    """The scorer train.py runs in the loop gives lm-eval's HFLM log-likelihoods (to 1e-4), also for an
    empty context, a context ending in a space and one longer than the model's context (cut from the
    left), in batches padded on the right; and so lm-eval's acc and acc_norm."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    model_dir, items_file, items = exported
    edge = [
        {"context": "", "choices": ["the cat", "blue sky"], "answer": 0},
        {"context": "the cat sat on ", "choices": ["the mat", "a dog"], "answer": 0},
        {"context": " ".join(WORDS * 30), "choices": ["one two", "ran far in the park"], "answer": 1},
    ]
    requests = [(item["context"], " " + choice) for item in items + edge for choice in item["choices"]]
    hflm = HFLM(pretrained=str(model_dir), device="cpu", batch_size=5)
    expected = [
        value
        for value, _ in hflm.loglikelihood(
            [Instance("loglikelihood", {}, pair, index) for index, pair in enumerate(requests)], disable_tqdm=True
        )
    ]
    ours = loop_log_likelihoods(model_dir, items + edge, token_budget=300)
    assert len(ours) == len(expected) and max(abs(a - b) for a, b in zip(ours, expected)) < 1e-4
    assert len({round(value, 3) for value in ours}) > len(ours) // 2  # the model tells the choices apart

    lm_eval_scores, _ = evaluation.lm_eval_scores(
        str(model_dir), evaluation.resolve_tasks([str(items_file)]), None, 8, "cpu", evaluation.DEFAULT_SEED
    )
    counts = evaluation.choice_counts(items, loop_log_likelihoods(model_dir, items, token_budget=10_000))
    loop = evaluation.loop_scores([evaluation.LoopTask("local_words", tuple(items))], [counts])
    for metric in ("acc", "acc_norm", "acc_bytes"):
        assert loop["local_words"][metric] == pytest.approx(lm_eval_scores["local_words"][metric], abs=1e-4)


def test_loop_tasks_from_files_and_lm_eval_yaml_are_cut_and_kept(exported, tmp_path):
    """--eval-tasks: a JSONL file as it is; an lm-eval task YAML read through lm-eval once and kept in
    RUN/eval_tasks (a resume reads it there, even without the dataset); --eval-tasks-limit subsamples."""
    _, items_file, items = exported
    yaml_file = tmp_path / "mine.yaml"
    yaml_file.write_text(evaluation.task_yaml("mine", str(items_file)))
    kept = tmp_path / "run" / evaluation.LOOP_TASKS_DIR
    tasks = evaluation.load_loop_tasks([f"{items_file},{yaml_file}"], 0, kept)
    assert [(task.name, len(task.items)) for task in tasks] == [("local_words", 24), ("mine", 24)]
    assert list(tasks[0].items) == items and list(tasks[1].items) == items  # lm-eval's view of the same items
    assert evaluation.read_choice_items(kept / "mine.jsonl") == items
    items_file.rename(tmp_path / "gone.jsonl")  # the dataset is gone: the kept items are scored
    try:
        again = evaluation.load_loop_tasks([str(yaml_file)], 10, kept)
    finally:
        (tmp_path / "gone.jsonl").rename(items_file)
    pick = evaluation.seeded_subsample(24, 10)
    assert list(again[0].items) == [items[index] for index in pick]
    (tmp_path / "sums.jsonl").write_text('{"prompt": "What is 1 plus 2?", "answer": "3"}\n')
    with pytest.raises(UserError, match="exact-match task .* scored by `report.py evaluate`"):
        evaluation.load_loop_tasks([str(tmp_path / "sums.jsonl")], 0, kept)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "words.jsonl").write_text(items_file.read_text())
    with pytest.raises(UserError, match="more than one task named local_words"):
        evaluation.load_loop_tasks([str(items_file), str(tmp_path / "other" / "words.jsonl")], 0, kept)
    with pytest.raises(UserError, match="^--eval-tasks missing.jsonl: no such task file$"):  # its own option
        evaluation.load_loop_tasks(["missing.jsonl"], 0, kept)
    (tmp_path / "bad.yaml").write_text("dataset_path: json\n")
    with pytest.raises(UserError, match=r"bad.yaml: an lm-eval task YAML needs a `task: NAME` line"):
        evaluation.load_loop_tasks([str(tmp_path / "bad.yaml")], 0, kept)


def test_report_evaluate_faults_are_one_line_worded_as_eval_tasks(exported, tmp_path):
    """report.py evaluate and train.py --eval-tasks say each fault (a dataset that does not load, as offline; an
    unknown task; a missing or broken model) in one line, in the same words but for the option's name."""
    import subprocess

    model_dir, items_file, _ = exported
    gone = tmp_path / "gone.yaml"  # its dataset cannot be read: what an offline Kaggle session meets
    gone.write_text(evaluation.task_yaml("gone", str(tmp_path / "no-such-items.jsonl")))
    said = {}
    for flag, call in (
        ("--tasks", lambda spec: report.main(["evaluate", str(model_dir), "--tasks", spec])),
        ("--eval-tasks", lambda spec: evaluation.load_loop_tasks([spec], 0, None)),
    ):
        with pytest.raises(UserError) as error:
            call(str(gone))
        said[flag, "dataset"] = str(error.value)
        with pytest.raises(UserError) as error:
            call("no_such_task_anywhere")
        said[flag, "unknown"] = str(error.value)
    assert said["--tasks", "dataset"].startswith("--tasks gone: its dataset did not load (")
    for kind in ("dataset", "unknown"):
        assert said["--tasks", kind].replace("--tasks", "--eval-tasks", 1) == said["--eval-tasks", kind]
        assert "\n" not in said["--tasks", kind]
    assert said["--tasks", "unknown"] == (
        "--tasks no_such_task_anywhere: neither a task file nor an lm-eval task name (`lm_eval ls tasks` lists them)"
    )
    with pytest.raises(UserError, match=r"^\S*nowhere: no such run or model folder$"):
        report.main(["evaluate", str(tmp_path / "nowhere"), "--tasks", "arc_easy"])
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((model_dir / "config.json").read_text())  # no weights, no tokenizer
    with pytest.raises(UserError, match=r"^\S*broken: the model did not load \(\w+: .*\)$"):
        report.main(["evaluate", str(broken), "--tasks", str(items_file)])
    result = subprocess.run(
        [sys.executable, "report.py", "evaluate", str(model_dir), "--tasks", str(gone)],
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines() == [f"error: {said['--tasks', 'dataset']}"]


# ----------------------------------------------------------------------------------------------
# Exact-match tasks: the final answer of a greedy chat reply


def test_extract_final_answer_and_scoring():
    assert evaluation.extract_final_answer("<think>\n10 + 7 = 17\n</think>\n\n 17 ") == "17"
    assert evaluation.extract_final_answer("<think>a</think>b</think> 3") == "3"
    assert evaluation.extract_final_answer(" 42\n") == "42"
    assert evaluation.extract_final_answer("<think>\nunfinished 17") == "<think>\nunfinished 17"
    examples = [
        {"prompt": "a", "answer": "17", "task": "add"},
        {"prompt": "b", "answer": "5", "task": "add"},
        {"prompt": "c", "answer": "9", "task": "mul"},
    ]
    result = evaluation.score_answers(examples, ["<think>x</think>\n\n17", "5 apples", "9"])
    assert (result["correct"], result["total"], result["accuracy"]) == (2, 3, 2 / 3)
    assert result["by_task"] == {
        "add": {"correct": 1, "total": 2, "accuracy": 0.5},
        "mul": {"correct": 1, "total": 1, "accuracy": 1.0},
    }
    assert [(w["prompt"], w["predicted"]) for w in result["wrong_examples"]] == [("b", "5 apples")]


def test_exact_match_accuracy_with_a_real_model(chat_model, tmp_path):
    model, tokenizer = chat_model
    folder = tmp_path / "eval"
    folder.mkdir()
    (folder / "addition.jsonl").write_text(
        json.dumps({"prompt": "What is 2 plus 3?", "answer": 5, "task": "addition"})
        + "\n"
        + json.dumps({"prompt": "What is 10 plus 7?", "answer": "17", "task": "addition"})
        + "\n\n"
    )
    (folder / "words.jsonl").write_text(json.dumps({"prompt": "Name a color.", "answer": "Red"}) + "\n")

    result = evaluation.exact_match_accuracy(model, tokenizer, folder, device="cpu", max_new_tokens=24)
    assert (result["correct"], result["total"]) == (2, 3)
    assert result["accuracy"] == pytest.approx(2 / 3)
    assert result["by_task"]["addition"] == {"correct": 2, "total": 2, "accuracy": 1.0}
    assert result["by_task"]["words"] == {"correct": 0, "total": 1, "accuracy": 0.0}
    assert [(w["answer"], w["predicted"]) for w in result["wrong_examples"]] == [("Red", "Blue")]

    limited = evaluation.exact_match_accuracy(model, tokenizer, folder / "addition.jsonl", limit=1, max_new_tokens=24)
    assert (limited["correct"], limited["total"]) == (1, 1)

    (folder / "words.jsonl").write_text('{"prompt": "Name a color."}\n')
    with pytest.raises(UserError, match=r"words.jsonl:1: .*answer"):
        evaluation.exact_match_accuracy(model, tokenizer, folder)
    with pytest.raises(UserError, match="not found"):
        evaluation.exact_match_accuracy(model, tokenizer, tmp_path / "nope.jsonl")
