"""Benchmark scores of an exported model: `python report.py evaluate MODEL_OR_RUN --tasks ...`.

Multiple-choice tasks are scored by lm-evaluation-harness (`lm-eval`, an optional dependency),
so the numbers are lm-eval's own: standard tasks by name (hellaswag, arc_easy, piqa, ...) when
the datasets can be reached, and local JSONL files, one item a line,

    {"context": str, "choices": [str, ...], "answer": int}

turned into a local task YAML (the choice follows the context after one space; zero-shot).
`acc` picks the choice with the highest summed token log-probability, `acc_norm` divides it by
the choice's length in characters and `acc_bytes` by its UTF-8 bytes (lm-eval's definitions).
Exact-match task files ({"prompt", "answer", "task"} a line, e.g. the demo's CORPUS/eval/) are
the other kind of task: greedy chat replies (generation.py), the final answer compared as text
(score_answers); the end of a run scores CORPUS/eval/ the same way (exact_match_accuracy).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import re
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tinyllm.common import UserError, atomic_write_json, atomic_write_text, jsonl_records, sha256_file, utc_now
from tinyllm.data import corpus_format, demo_corpus
from tinyllm.model import generation
from tinyllm.outputs import export_hf
from tinyllm.store import checkpoint_store as store

LM_EVAL_INSTALL = "pip install 'lm-eval>=0.4.13,<0.5' 'accelerate>=1.1'"  # accelerate: lm-eval's HF model class
CHOICE_METRICS = ("acc", "acc_norm", "acc_bytes")
DEFAULT_SEED = 1234


def require_lm_eval():
    """lm_eval, or one error line saying how to install it."""
    try:
        import accelerate  # noqa: F401
        import lm_eval
    except ImportError as error:
        raise UserError(
            f"multiple-choice and lm-eval tasks need lm-evaluation-harness ({error.name} is not "
            f"installed): {LM_EVAL_INSTALL}"
        ) from None
    return lm_eval


# ----------------------------------------------------------------------------------------------
# lm-eval's tasks loaded, their faults as one line: the same words under report.py evaluate --tasks and
# train.py --eval-tasks (`flag` names the option).


def unknown_tasks_text(flag: str, names: Sequence[str]) -> str:
    return f"{flag} {', '.join(names)}: neither a task file nor an lm-eval task name (`lm_eval ls tasks` lists them)"


def dataset_failure_text(flag: str, name: str, error: BaseException) -> str:
    """One line for a task whose dataset did not load: offline (a Kaggle session with internet off), gated,
    missing, a bad config."""
    detail = (str(error).strip().splitlines() or [""])[0][:300]
    return f"{flag} {name}: its dataset did not load ({type(error).__name__}: {detail})"


@contextlib.contextmanager
def quiet_hub():
    """huggingface_hub's retry warnings off (five 'Retrying in 1s' lines before an offline failure, said once by
    dataset_failure_text instead)."""
    hub = logging.getLogger("huggingface_hub")
    level = hub.level
    hub.setLevel(logging.ERROR)
    try:
        yield
    finally:
        hub.setLevel(level)


def load_lm_eval_tasks(names: Sequence[str], manager, flag: str) -> dict:
    """lm-eval's {name: task or group} of `names` (their datasets loaded), each fault one UserError naming `flag`."""
    from lm_eval.tasks import get_task_dict

    unknown = [name for name in names if name not in manager.all_tasks]
    if unknown:
        raise UserError(unknown_tasks_text(flag, unknown))
    loaded = {}
    for name in names:
        try:
            with quiet_hub():
                loaded.update(get_task_dict([name], manager))
        except Exception as error:  # noqa: BLE001 - datasets fails many ways: offline, gated, missing, a bad config
            raise UserError(dataset_failure_text(flag, name, error)) from None
    return loaded


# ----------------------------------------------------------------------------------------------
# Tasks: names, local files, and the YAML that makes a JSONL file an lm-eval task.


def local_task_name(path: Path) -> str:
    """An lm-eval task name for a local file: its stem, with anything but [A-Za-z0-9_] as '_'."""
    return "local_" + re.sub(r"\W", "_", path.stem)


def read_choice_items(path: Path) -> list[dict]:
    """The items of a multiple-choice JSONL file, each checked, or one error naming the line."""
    items = []
    for number, item in jsonl_records(path):
        choices = item.get("choices") if isinstance(item, dict) else None
        if not (
            isinstance(item, dict)
            and isinstance(item.get("context"), str)
            and isinstance(choices, list)
            and len(choices) >= 2
            and all(isinstance(choice, str) and choice for choice in choices)
            and isinstance(item.get("answer"), int)
            and 0 <= item["answer"] < len(choices)
        ):
            raise UserError(
                f'{path}:{number}: expected {{"context": text, "choices": [two or more texts], '
                f'"answer": index of the right choice}}'
            )
        items.append(item)
    if not items:
        raise UserError(f"{path} holds no items")
    return items


def task_kind(path: Path) -> str:
    """'choice' for a {"context", "choices", "answer"} file, 'exact' for {"prompt", "answer"}."""
    with open(path, encoding="utf-8") as handle:
        first = next((line for line in handle if line.strip()), None)
    try:
        item = json.loads(first) if first else None
    except json.JSONDecodeError as error:
        raise UserError(f"{path}: not valid JSON ({error.msg})") from None
    if isinstance(item, dict) and "choices" in item:
        return "choice"
    if isinstance(item, dict) and "prompt" in item:
        return "exact"
    raise UserError(
        f'{path}: neither a multiple-choice file ({{"context", "choices", "answer"}} a line) '
        'nor an exact-match one ({"prompt", "answer"} a line)'
    )


def resolve_tasks(specs: Sequence[str], flag: str = "--tasks") -> list[dict]:
    """--tasks values as [{"name", "kind": "lm_eval" | "choice" | "exact", "path"}]: a file, a folder of
    *.jsonl files (each a task), or an lm-eval task name. Comma-separated values are split; errors name
    `flag`, the option the specs came from."""
    tasks = []
    for spec in (part for value in specs for part in value.split(",") if part):
        path = Path(spec)
        if path.suffix in (".yaml", ".yml") and path.is_file():  # an lm-eval task config of one's own
            tasks.append(
                {
                    "name": yaml_task_name(path),
                    "kind": "lm_eval",
                    "path": str(path.resolve()),
                    "include": str(path.resolve().parent),
                }
            )
            continue
        if path.is_dir():
            files = sorted(path.glob("*.jsonl"))
            if not files:
                raise UserError(f"{flag} {spec}: the folder holds no *.jsonl task files")
        elif path.suffix == ".jsonl" or path.exists():
            if not path.is_file():
                raise UserError(f"{flag} {spec}: no such task file")
            files = [path]
        else:
            tasks.append({"name": spec, "kind": "lm_eval", "path": None})
            continue
        for file in files:
            kind = task_kind(file)
            name = local_task_name(file) if kind == "choice" else file.stem
            tasks.append({"name": name, "kind": kind, "path": str(file.resolve())})
    if not tasks:
        raise UserError(f"{flag}: give at least one task name, task file or folder")
    return tasks


def yaml_task_name(path: Path) -> str:
    """The `task:` name of an lm-eval task YAML file."""
    import yaml

    try:
        config = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as error:
        raise UserError(f"{path}: not a readable lm-eval task YAML ({error})") from None
    if not (isinstance(config, dict) and isinstance(config.get("task"), str)):
        raise UserError(f"{path}: an lm-eval task YAML needs a `task: NAME` line")
    return config["task"]


def task_yaml(name: str, jsonl: str) -> str:
    """An lm-eval task config scoring a {"context", "choices", "answer"} JSONL file, zero-shot."""
    metrics = "".join(
        f"  - metric: {metric}\n    aggregation: mean\n    higher_is_better: true\n" for metric in CHOICE_METRICS
    )
    return (
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {json.dumps(jsonl)}\n"
        'test_split: test\noutput_type: multiple_choice\ntarget_delimiter: " "\nnum_fewshot: 0\n'
        'doc_to_text: "{{context}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
        f"metric_list:\n{metrics}"
    )


def seeded_subsample(size: int, limit: int | None, seed: int = DEFAULT_SEED) -> list[int] | None:
    """`limit` item indices out of `size`, the same for the same seed, in order; None means all."""
    if limit is None or limit >= size:
        return None
    if limit < 1:
        raise UserError(f"--limit {limit}: give a positive number of items")
    return sorted(random.Random(seed).sample(range(size), limit))


# ----------------------------------------------------------------------------------------------
# Scoring.


def lm_eval_scores(
    model_dir: str, tasks: list[dict], limit: int | None, batch_size: int, device: str, seed: int
) -> tuple[dict, dict]:
    """lm-eval's scores of the 'lm_eval' and 'choice' tasks: ({name: {acc, acc_norm, ..., n}}, harness info)."""
    lm_eval = require_lm_eval()
    from lm_eval import evaluator
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    local = [task for task in tasks if task["kind"] == "choice"]
    named = [task["name"] for task in tasks if task["kind"] == "lm_eval"]
    with tempfile.TemporaryDirectory(prefix="tinyllm-tasks-") as folder:
        sizes = {}
        for task in local:
            sizes[task["name"]] = len(read_choice_items(Path(task["path"])))
            Path(folder, f"{task['name']}.yaml").write_text(task_yaml(task["name"], task["path"]), encoding="utf-8")
        includes = ([folder] if local else []) + sorted({task["include"] for task in tasks if task.get("include")})
        manager = TaskManager(
            include_path=includes or None,
            verbosity="ERROR",
            include_defaults=any(task["kind"] == "lm_eval" and not task.get("include") for task in tasks),
        )
        loaded = load_lm_eval_tasks(named, manager, "--tasks")  # a fault is one line before the model loads
        if limit is not None:
            sizes.update(
                {
                    name: len(task.eval_docs)
                    for name, task in loaded.items()  # a group (mmlu) is scored
                    if isinstance(name, str) and hasattr(task, "eval_docs")
                }
            )  # whole: no size of its own
        picks = {name: seeded_subsample(size, limit, seed) for name, size in sizes.items()}
        samples = {name: pick for name, pick in picks.items() if pick is not None}
        model = load_hf_model(HFLM, model_dir, device, batch_size)
        with no_git_lookup(evaluator):
            output = lm_eval.simple_evaluate(
                model=model,
                tasks=[task["name"] for task in local] + named,
                task_manager=manager,
                samples=samples or None,
                num_fewshot=0,
                log_samples=False,
                random_seed=seed,
                numpy_random_seed=seed,
                torch_random_seed=seed,
                fewshot_random_seed=seed,
                verbosity="ERROR",
            )
    scores = {}
    for name, values in output["results"].items():
        scores[name] = {metric: values[f"{metric},none"] for metric in CHOICE_METRICS if f"{metric},none" in values}
        scores[name].update(
            {
                f"{metric}_stderr": values[f"{metric}_stderr,none"]
                for metric in CHOICE_METRICS
                if isinstance(values.get(f"{metric}_stderr,none"), float)
            }
        )
        scores[name]["n"] = output["n-samples"].get(name, {}).get("effective")
    harness = {
        "name": "lm-evaluation-harness",
        "lm_eval_version": lm_eval.__version__,
        "transformers_version": output.get("transformers_version"),
        "num_fewshot": 0,
        "target_delimiter": " ",
        "acc_norm": "log-probability per character of the choice",
        "acc_bytes": "log-probability per UTF-8 byte of the choice",
        "limit": limit,
        "seed": seed,
        "batch_size": batch_size,
        "device": device,
    }
    return scores, harness


def bars_off() -> bool:
    """Whether progress bars are off: TQDM_DISABLE, as run_main sets it where stderr is not a terminal (or the user)."""
    return os.environ.get("TQDM_DISABLE", "").lower() in ("1", "true", "yes", "on")


def quiet_hflm(hflm):
    """lm-eval's HFLM whose request bars follow TQDM_DISABLE: lm-eval passes tqdm `disable=False` itself, which
    outranks the variable, so a log file got a carriage-return bar per task."""

    class QuietHFLM(hflm):
        def loglikelihood(self, requests, disable_tqdm: bool = False):
            return super().loglikelihood(requests, disable_tqdm=disable_tqdm or bars_off())

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            return super().loglikelihood_rolling(requests, disable_tqdm=disable_tqdm or bars_off())

        def generate_until(self, requests, disable_tqdm: bool = False):
            return super().generate_until(requests, disable_tqdm=disable_tqdm or bars_off())

    return QuietHFLM


@contextlib.contextmanager
def no_git_lookup(evaluator):
    """simple_evaluate asks `git describe` for the working folder's commit, for its own log (not ours): outside
    a repository git prints 'fatal: not a git repository' to stderr. The scores do not depend on it: skipped."""
    lookup = evaluator.get_git_commit_hash
    evaluator.get_git_commit_hash = lambda: None
    try:
        yield
    finally:
        evaluator.get_git_commit_hash = lookup


def load_hf_model(hflm, model_dir: str, device: str, batch_size: int):
    """lm-eval's HFLM of `model_dir`, or one UserError when the folder does not load (weights missing, broken)."""
    try:
        return quiet_hflm(hflm)(pretrained=model_dir, device=device, batch_size=batch_size)
    except (OSError, ValueError, RuntimeError) as error:
        detail = (str(error).strip().splitlines() or [""])[0][:300]
        raise UserError(f"{model_dir}: the model did not load ({type(error).__name__}: {detail})") from None


# ----------------------------------------------------------------------------------------------
# Exact-match tasks ({"prompt", "answer", "task"} a line): greedy chat replies, the final answer compared as text.
# The end of a run scores CORPUS/eval/ so (exact_match_accuracy), `report.py evaluate` too (exact_match_scores).


def read_eval_examples(path: str | os.PathLike, limit: int | None = None) -> list[dict]:
    """Task examples from a .jsonl file, or from every *.jsonl in a folder (sorted by name).

    Each line: {"prompt": str, "answer": str|number, "task": str}; `task` defaults to the file's
    stem. Returns the first `limit` examples (all when None).
    """
    root = Path(path)
    if not root.exists():
        raise UserError(f"eval set not found: {root}")
    files = sorted(root.glob("*.jsonl")) if root.is_dir() else [root]
    if not files:
        raise UserError(f"eval folder {root} holds no *.jsonl files")
    examples = []
    for file in files:
        for number, item in jsonl_records(file):
            if not isinstance(item, dict) or not isinstance(item.get("prompt"), str) or "answer" not in item:
                raise UserError(f'{file}:{number}: expected an object with "prompt" (text) and "answer"')
            examples.append(
                {
                    "prompt": item["prompt"],
                    "answer": str(item["answer"]).strip(),
                    "task": str(item.get("task", file.stem)),
                }
            )
            if limit is not None and len(examples) >= limit:
                return examples
    if not examples:
        raise UserError(f"eval set {root} has no examples")
    return examples


def extract_final_answer(completion: str) -> str:
    """The answer part of a reply: the text after the last </think> when there is one, stripped."""
    if corpus_format.THINK_CLOSE in completion:
        completion = completion.rsplit(corpus_format.THINK_CLOSE, 1)[1]
    return completion.strip()


def score_answers(examples: Sequence[dict], completions: Sequence[str], max_wrong_examples: int = 5) -> dict:
    """Exact-match accuracy of `completions` against the examples' answers, overall and per task."""
    by_task: dict[str, dict] = {}
    wrong = []
    correct_total = 0
    for example, completion in zip(examples, completions, strict=True):
        predicted = extract_final_answer(completion)
        correct = predicted == example["answer"]
        correct_total += correct
        task = by_task.setdefault(example["task"], {"correct": 0, "total": 0})
        task["correct"] += correct
        task["total"] += 1
        if not correct and len(wrong) < max_wrong_examples:
            wrong.append({**example, "predicted": predicted, "completion": completion})
    for task in by_task.values():
        task["accuracy"] = task["correct"] / task["total"]
    total = len(examples)
    return {
        "accuracy": correct_total / total if total else 0.0,
        "correct": correct_total,
        "total": total,
        "by_task": dict(sorted(by_task.items())),
        "wrong_examples": wrong,
    }


def score_replies(
    model, tokenizer, examples: Sequence[dict], max_new_tokens: int = 96, device=None, batch_size: int = 16
) -> dict:
    """score_answers of greedy chat replies to the examples' prompts."""
    completions = generation.generate_chat(
        model, tokenizer, [example["prompt"] for example in examples], max_new_tokens, device, batch_size
    )
    return score_answers(examples, completions)


def exact_match_accuracy(
    model,
    tokenizer,
    eval_path: str | os.PathLike,
    device=None,
    limit: int | None = None,
    max_new_tokens: int = 96,
    batch_size: int = 32,
) -> dict:
    """Held-out task accuracy (the end of a run): greedy replies through the chat template, exact match on the
    answer, over the first `limit` examples.

    Returns {"accuracy", "correct", "total", "by_task": {task: {accuracy, correct, total}},
    "wrong_examples": [...up to 5], "eval_path", "settings"}.
    """
    result = score_replies(model, tokenizer, read_eval_examples(eval_path, limit), max_new_tokens, device, batch_size)
    result["eval_path"] = str(eval_path)
    result["settings"] = {"decoding": "greedy", "max_new_tokens": max_new_tokens, "limit": limit}
    return result


def exact_match_scores(
    model_dir: str, tasks: list[dict], limit: int | None, device: str, seed: int, max_new_tokens: int
) -> dict:
    """Greedy chat replies against the answers of exact-match task files, over a seeded subsample of `limit`."""
    scores = {}
    if not tasks:
        return scores
    model, tokenizer = generation.load_exported(model_dir, device)
    for task in tasks:
        examples = read_eval_examples(task["path"])
        pick = seeded_subsample(len(examples), limit, seed)
        chosen = examples if pick is None else [examples[index] for index in pick]
        result = score_replies(model, tokenizer, chosen, max_new_tokens, device)
        scores[task["name"]] = {
            "exact_match": result["accuracy"],
            "n": result["total"],
            "correct": result["correct"],
            "by_task": result["by_task"],
        }
    return scores


def model_and_run(model_or_run: str) -> tuple[Path, Path | None]:
    """(the exported model folder, the run folder or None) from RUN or RUN/model."""
    path = Path(model_or_run)
    if not path.exists():
        raise UserError(f"{path}: no such run or model folder")
    if (path / "model" / "config.json").is_file():
        return path / "model", path
    if (path / "config.json").is_file():
        return path, path.parent if (path.parent / "run_status.json").is_file() else None
    raise UserError(f"{path} is neither a run folder (with model/) nor an exported model folder (no config.json)")


def evaluate(
    model_or_run: str,
    task_specs: Sequence[str],
    limit: int | None = None,
    batch_size: int = 32,
    device: str = "cpu",
    seed: int = DEFAULT_SEED,
    max_new_tokens: int = 96,
) -> dict:
    """{"tasks": {name: {...scores, "n", "kind"}}, "model", "run", "harness", "time"}: every task, one record."""
    model_dir, run = model_and_run(model_or_run)
    tasks = resolve_tasks(task_specs)
    by_kind = {
        kind: [task for task in tasks if task["kind"] in kinds]
        for kind, kinds in (("lm_eval", ("lm_eval", "choice")), ("exact", ("exact",)))
    }
    scores, harness = {}, {"limit": limit, "seed": seed, "device": device}
    if by_kind["lm_eval"]:
        scores, harness = lm_eval_scores(str(model_dir), by_kind["lm_eval"], limit, batch_size, device, seed)
    scores.update(exact_match_scores(str(model_dir), by_kind["exact"], limit, device, seed, max_new_tokens))
    if by_kind["exact"]:
        harness["exact_match"] = {"decoding": "greedy", "chat_template": True, "max_new_tokens": max_new_tokens}
    for task in tasks:
        scores[task["name"]].update(kind=task["kind"], source=task["path"] or "lm-eval")
    return {
        "format_version": 1,
        "time": utc_now(),
        "model": str(model_dir),
        "run": str(run) if run else None,
        "model_sha256": sha256_file(model_dir / "model.safetensors")
        if (model_dir / "model.safetensors").is_file()
        else None,
        "tasks": {task["name"]: scores[task["name"]] for task in tasks},
        "harness": harness,
    }


# ----------------------------------------------------------------------------------------------
# What a run keeps of its scores: RUN/eval/*.json, the model card's benchmark section (export_hf).


def write_outputs(result: dict, json_out: str | None = None) -> list[Path]:
    """--json OUT, RUN/eval/<task>.json and the model card's scores; returns the files written."""
    written = []
    if json_out:
        atomic_write_json(json_out, result)
        written.append(Path(json_out))
    if result["run"]:
        for name, scores in result["tasks"].items():
            path = Path(result["run"]) / "eval" / f"{name}.json"
            path.parent.mkdir(exist_ok=True)
            atomic_write_json(
                path, {**{key: result[key] for key in result if key != "tasks"}, "task": name, "scores": scores}
            )
            written.append(path)
    card = export_hf.write_scores(Path(result["model"]), result)
    if card is not None:
        written.append(card)
        record_card_hash(result["run"], card)
    return written


def kept_scores(run: Path, weights_sha256: str | None) -> dict | None:
    """The newest evaluation that RUN/eval/*.json holds of the weights of `weights_sha256` (model.safetensors'
    digest, as the export hashed it), as one result for the card's benchmark section; None: none of these
    weights. An export made again (the same command after the run completed, --export-only) keeps the scores the
    card had; new weights lose them."""
    if weights_sha256 is None:
        return None
    records = []
    for path in sorted((run / "eval").glob("*.json")):
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue  # not ours to judge: the card keeps what it can read
        if (
            isinstance(record, dict)
            and record.get("model_sha256") == weights_sha256
            and isinstance(record.get("scores"), dict)
        ):
            records.append(record)
    if not records:
        return None
    newest = max(record.get("time", "") for record in records)
    latest = [record for record in records if record.get("time", "") == newest]  # one evaluation's tasks
    meta = {key: value for key, value in latest[0].items() if key not in ("task", "scores")}
    return {**meta, "tasks": {record["task"]: record["scores"] for record in latest}}


def record_card_hash(run: str | None, card: Path) -> None:
    """Keep run_status.json's sha256 of model/README.md true after the card gained its scores (its one
    writer, checkpoint_store.RunStatus, amends the finished run's record)."""
    if run is None:
        return
    status = store.RunStatus(Path(run))
    model_files = status.previous.get("model_files")
    if isinstance(model_files, dict) and "README.md" in model_files:
        status.amend(model_files={**model_files, "README.md": sha256_file(card)})


# ----------------------------------------------------------------------------------------------
# The demo's held-out problems as a multiple-choice task (tests/test_demo.py, bench/bench_evaluate.py).


def demo_choice_items(tokenizer, seed: int = 0) -> list[dict]:
    """The demo's held-out problems (demo_corpus.demo_held_out) as {"context", "choices", "answer"} items: the chat
    prompt and the worked reply up to its last ' = ' as the context; the right result (and answer) among
    three wrong ones near it, at a seeded position. Chance is 0.25."""
    rng = random.Random(seed)
    prompts = {
        "addition": demo_corpus.ADDITION_PROMPTS,
        "subtraction": demo_corpus.SUBTRACTION_PROMPTS,
        "multiplication": demo_corpus.APPLE_PROMPTS,
    }
    items = []
    for task, pairs in demo_corpus.demo_held_out(random.Random(demo_corpus.DEMO_SEED)).items():
        for a, b in sorted(pairs):
            problem = demo_corpus.demo_problem(task, a, b, prompts[task][0])
            reply = corpus_format.render_assistant(problem["answer"], problem["reasoning"])
            cut = reply.rindex(" = ")
            right = int(problem["answer"])
            wrong = rng.sample([value for value in range(max(0, right - 9), right + 10) if value != right], 3)
            choices = [reply[cut + 3 :].replace(problem["answer"], str(value)) for value in wrong]
            answer = rng.randint(0, 3)
            choices.insert(answer, reply[cut + 3 :])
            context = (
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": problem["prompt"]}], tokenize=False, add_generation_prompt=True
                )
                + reply[: cut + 2]
            )
            items.append({"context": context, "choices": choices, "answer": answer})
    return items


# ----------------------------------------------------------------------------------------------
# In the loop: train.py --eval-tasks scores multiple-choice tasks on the model being trained, with
# lm-eval's conventions (the same items give lm_eval's acc and acc_norm), each rank a share of the items.

DEFAULT_LOOP_LIMIT = 200  # items per task in the loop (seeded, the same every time): see bench/bench_evaluate.py
LOOP_TASKS_DIR = "eval_tasks"  # RUN/eval_tasks/NAME.jsonl: the items of an lm-eval task, kept for the resumes


@dataclass(frozen=True)
class LoopTask:
    """A multiple-choice task scored during training: its name and the items scored."""

    name: str
    items: tuple[dict, ...]

    @property
    def chance(self) -> float:
        return sum(1 / len(item["choices"]) for item in self.items) / len(self.items)


def lm_eval_items(name: str, include: str | None = None) -> list[dict]:
    """A zero-shot lm-eval multiple-choice task's items as {"context", "choices", "answer"}: the context,
    choices and target lm-eval itself builds (its fewshot_context with no shots)."""
    require_lm_eval()
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=include, include_defaults=include is None, verbosity="ERROR")
    task = load_lm_eval_tasks([name], manager, "--eval-tasks")[name]
    try:
        docs = list(task.eval_docs) if hasattr(task, "eval_docs") else None
    except Exception as error:  # noqa: BLE001 - datasets fails many ways: offline, gated, missing, a bad config
        raise UserError(dataset_failure_text("--eval-tasks", name, error)) from None
    if docs is None or task.OUTPUT_TYPE != "multiple_choice" or task.config.target_delimiter != " ":
        raise UserError(
            f"--eval-tasks {name}: not one multiple-choice task whose choice follows the context "
            "after a space (a group, another output type or delimiter); the loop scores those, "
            "`report.py evaluate` scores the rest"
        )
    items = []
    for doc in docs:
        context, choices, target = task.fewshot_context(doc, 0), task.doc_to_choice(doc), task.doc_to_target(doc)
        if not isinstance(context, str) or isinstance(target, list):
            raise UserError(
                f"--eval-tasks {name}: items with several contexts or answers are not scored in the "
                "loop (`report.py evaluate` scores them)"
            )
        answer = choices.index(target) if isinstance(target, str) else int(target)
        items.append({"context": context, "choices": list(choices), "answer": answer})
    return items


def load_loop_tasks(specs: Sequence[str], limit: int, kept: Path | None) -> list[LoopTask]:
    """--eval-tasks: its multiple-choice files, folders, lm-eval task YAML files and names, each cut to `limit`
    items (0: all) by seeded_subsample. An lm-eval task's items are read once and kept in `kept`/NAME.jsonl
    (RUN/eval_tasks), so a resumed run scores the same items without reaching the dataset again."""
    tasks = []
    for task in resolve_tasks(specs, "--eval-tasks"):
        if task["kind"] == "exact":
            raise UserError(
                f"--eval-tasks {task['path']}: an exact-match task (greedy replies) is scored by "
                "`report.py evaluate`; the loop scores multiple-choice tasks"
            )
        if task["kind"] == "choice":
            items = read_choice_items(Path(task["path"]))
        else:
            items = kept_lm_eval_items(task, kept)
        pick = seeded_subsample(len(items), limit or None)
        chosen = items if pick is None else [items[index] for index in pick]
        tasks.append(LoopTask(task["name"], tuple(chosen)))
    names = [task.name for task in tasks]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise UserError(
            f"--eval-tasks: more than one task named {', '.join(twice)} (a file's task is named "
            "after its stem: rename one)"
        )
    return tasks


def kept_lm_eval_items(task: dict, kept: Path | None) -> list[dict]:
    """An lm-eval task's items, from `kept`/NAME.jsonl when an earlier session read them."""
    path = None if kept is None else kept / f"{task['name']}.jsonl"
    if path is not None and path.is_file():
        return read_choice_items(path)
    items = lm_eval_items(task["name"], task.get("include"))
    if path is None:
        return items
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, "".join(json.dumps(item, ensure_ascii=False) + "\n" for item in items))
    return read_choice_items(path)  # checked as a file of one's own is, so a resume reads it back


def encode_pair(context: str, continuation: str, encode, prefix_id: int) -> tuple[list[int], list[int]]:
    """(context tokens, continuation tokens) as lm-eval's HFLM makes them: the context's trailing spaces
    move to the continuation, the two are encoded together and split where the context alone ends;
    an empty context is the prefix token (BOS)."""
    if not context:
        tokens = encode(continuation)
        return ([prefix_id], tokens) if tokens[:1] != [prefix_id] else (tokens[:1], tokens[1:])
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole, context_tokens = encode(context + continuation), encode(context)
    return context_tokens, whole[len(context_tokens) :]


def choice_rows(items: Sequence[dict], encode, prefix_id: int, max_length: int) -> list[tuple[list[int], int]]:
    """One (input tokens, continuation length) per choice of each item, in order: the context and the
    choice after one space, cut from the left to max_length + 1 tokens, the last one only a target (HFLM)."""
    rows = []
    for item in items:
        for choice in item["choices"]:
            context, continuation = encode_pair(item["context"], " " + choice, encode, prefix_id)
            rows.append(((context + continuation)[-(max_length + 1) :], len(continuation)))
    return rows


class LoopScorer:
    """--eval-tasks on one rank: every world-th item of each task, encoded once as lm-eval's HFLM encodes
    them (choice_rows), scored on demand on the model as it is (losses.continuation_log_likelihoods)."""

    def __init__(self, tasks: Sequence[LoopTask], tokenizer, rank: int, world: int, max_length: int):
        def encode(text: str) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=False)

        self.tasks = list(tasks)
        self.shares = [task.items[rank::world] for task in self.tasks]
        self.rows = [choice_rows(items, encode, tokenizer.bos_token_id, max_length) for items in self.shares]

    @property
    def tokens(self) -> int:
        """The tokens this rank feeds the model per scoring."""
        return sum(len(tokens) for rows in self.rows for tokens, _ in rows)

    def counts(self, model, device, token_budget: int) -> list[list[float]]:
        """choice_counts of this rank's share of each task (sum them over the ranks, then loop_scores)."""
        from tinyllm.model import losses

        return [
            choice_counts(items, losses.continuation_log_likelihoods(model, rows, device, token_budget))
            for items, rows in zip(self.shares, self.rows)
        ]


TASKS_COST_SHARE = 0.05  # --eval-tasks-every's default keeps the scoring to about this share of the training


def default_tasks_every(validation_every: int, total_steps: int, task_tokens: int, step_tokens: int) -> int:
    """--eval-tasks-every's default: the validation's cadence, or the smallest multiple of it at which
    scoring the tasks costs at most TASKS_COST_SHARE of the training in between, counting a scored
    token (a forward) as a third of a trained one (forward and backward); 0, only at the end, when no
    multiple within the run fits. `task_tokens` (LoopScorer.tokens) and `step_tokens` are one rank's."""
    if validation_every == 0:
        return 0
    needed = task_tokens / (3 * TASKS_COST_SHARE * step_tokens)
    every = validation_every * max(1, math.ceil(needed / validation_every))
    return every if every < total_steps else 0


def tasks_cadence_note(validation_every: int, tasks_every: int, task_tokens: int, step_tokens: int) -> str | None:
    """What the run says at its start when default_tasks_every scores the --eval-tasks later than the validation
    (every k-th one, or only at the end), and why; None when they go together."""
    if tasks_every == validation_every or validation_every == 0:
        return None
    cost = task_tokens / (3 * validation_every * step_tokens)  # a scored token a third of a trained one
    when = (
        f"every {tasks_every} steps (with one validation in {tasks_every // validation_every})"
        if tasks_every
        else "only at the end"
    )
    return (
        f"note: --eval-tasks are scored {when}, not with each validation (every {validation_every} steps): one "
        f"scoring reads {task_tokens:,} tokens, about {100 * cost:.0f}% of the training between two validations, "
        f"and the default keeps it near {100 * TASKS_COST_SHARE:.0f}%; --eval-tasks-every N chooses"
    )


def choice_counts(items: Sequence[dict], log_likelihoods: Sequence[float]) -> list[float]:
    """[acc, acc_norm, acc_bytes right answers, items] of `items` given each choice's summed log-likelihood
    (in choice_rows' order): the highest sum, per character and per UTF-8 byte of the choice (lm-eval's
    definitions; ties go to the first choice, as numpy's argmax does)."""
    counts, at = [0.0, 0.0, 0.0, float(len(items))], 0
    for item in items:
        choices = item["choices"]
        sums = log_likelihoods[at : at + len(choices)]
        at += len(choices)
        for slot, length in enumerate((lambda choice: 1, len, lambda choice: len(choice.encode("utf-8")))):
            scores = [value / length(choice) for value, choice in zip(sums, choices)]
            counts[slot] += scores.index(max(scores)) == item["answer"]
    return counts


def loop_scores(tasks: Sequence[LoopTask], counts: Sequence[Sequence[float]]) -> dict[str, dict]:
    """{name: {acc, acc_norm, acc_bytes, n, chance}} from each task's choice_counts summed over the ranks."""
    scores = {}
    for task, (acc, acc_norm, acc_bytes, n) in zip(tasks, counts):
        scores[task.name] = {
            "acc": acc / n,
            "acc_norm": acc_norm / n,
            "acc_bytes": acc_bytes / n,
            "n": int(n),
            "chance": task.chance,
        }
    return scores
