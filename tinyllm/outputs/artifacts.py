"""The end of a run as artifacts: each output a session makes at its end (rank 0, with --report) is one
observer (callbacks.Callback) that makes it in on_end, declares the run files it writes (`files`) and returns
what run_status.json says of it; a failure goes into run_status.json's `report_errors`, never up (the last
checkpoint is on disk and safe).

    facts = RunFacts(RUN, corpus, preset, settings, sampling, device)
    observers += end_of_run(model, facts, metrics, progress)         # train.run_callbacks
    found = callbacks.Callbacks(observers).on_end(end)                # train.finish_on_main: into run_status.json
    make_from_checkpoint(checkpoint, path, RUN, corpus, sampling, device)   # train.py --export-only: the same

ARTIFACTS is the one list of them: end_of_run makes them in its order (a later one reads what an earlier one
found, as the model card reads the held-out accuracy: `Ending.found`), --export-only runs the same ones, and
publishing uploads the files they declare published (publishing.PUBLISHED_RUN_FILES). A new end-of-run output
is a class here added to ARTIFACTS, and its test in tests/test_artifacts.py. What they write is made again
from the checkpoint and the run's history (metrics.jsonl, the settings): the backup carries the history
(checkpoint_store.RUN_FILES), none of these.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tinyllm.common import UserError, read_json, say, sha256_file
from tinyllm.data import corpus_format
from tinyllm.model import attention, generation
from tinyllm.model import config as model_config
from tinyllm.outputs import callbacks, evaluation, export_hf, metrics_log
from tinyllm.outputs.callbacks import RunEnd
from tinyllm.store import checkpoint_store as store


@dataclass(frozen=True)
class RunFile:
    """A file (or folder) of RUN an artifact writes; `published`: `report.py publish` uploads it beside model/."""

    name: str
    published: bool = False


@dataclass(frozen=True)
class RunFacts:
    """What the artifacts need of a run besides its model, fixed for a session (train.py builds it)."""

    out: Path
    corpus: Path
    preset: str  # the preset's name (--preset)
    settings: dict  # the recorded settings (training_settings.json's)
    sampling: generation.Sampling  # --sample-* for the samples
    device: Any


class Ending:
    """What the artifacts of one end of a run share: the model, the run's facts, its metrics log (and progress
    for the lines during the run), the corpus's tokenizer loaded once, and the run_status.json fields the
    artifacts found so far (`found`)."""

    def __init__(self, model, facts: RunFacts, metrics: metrics_log.MetricsLog, progress=None):
        self.model, self.facts, self.metrics, self.progress = model, facts, metrics, progress
        self.found: dict = {}
        self._tokenizer, self._tokenizer_tried = None, False

    def tokenizer(self):
        """The corpus's tokenizer. A failure to load it raises once (the artifact that asked first reports it
        as "tokenizer"); every later call gives None."""
        if not self._tokenizer_tried:
            self._tokenizer_tried = True
            self._tokenizer = corpus_format.load_tokenizer(self.facts.corpus)
        return self._tokenizer


class Artifact(callbacks.Callback):
    """An end-of-run output: `make(end)` returns its run_status.json fields; what fails in it is recorded
    under its `name` (or the name `attempt` gives a part of it) in report_errors."""

    name: str  # its name in run_status.json's report_errors
    files: tuple[RunFile, ...] = ()  # what it writes in RUN

    def __init__(self, ending: Ending):
        self.ending = ending
        self.errors: dict[str, str] = {}

    def on_end(self, end: RunEnd) -> dict:
        self.errors = {}
        found = self.attempt(self.name, lambda: self.make(end)) or {}
        self.ending.found.update(found)
        return {**found, "report_errors": self.errors or None}

    def make(self, end: RunEnd) -> dict:
        raise NotImplementedError

    def attempt(self, name: str, function):
        """function(), or None with the failure recorded under `name` and a warning."""
        try:
            return function()
        except Exception as error:  # the checkpoint is safe; a report failure must not lose the run
            self.errors[name] = f"{type(error).__name__}: {error}"
            say(f"{name} failed ({self.errors[name]}); the checkpoints are intact", warning=True)
            return None

    def tokenizer(self):
        return self.attempt("tokenizer", self.ending.tokenizer)

    def path(self) -> Path:
        """RUN/ its (first) file."""
        return self.ending.facts.out / self.files[0].name


class LossCurve(Artifact):
    """RUN/loss_curve.png from metrics.jsonl (metrics_log.plot_loss_curve): redrawn after each step that
    evaluated, a failure then a warning line, and at the end."""

    name = "loss_curve"
    files = (RunFile("loss_curve.png", published=True),)

    def on_evaluated(self, step: int, measured: list[callbacks.Measured]) -> None:
        try:
            self.draw()
        except Exception as error:
            self.ending.progress.write(f"warning: {self.files[0].name} not drawn ({type(error).__name__}: {error})")

    def make(self, end: RunEnd) -> dict:
        self.draw()
        return {}

    def draw(self) -> bool:
        out = self.ending.facts.out
        return metrics_log.plot_loss_curve(out / "metrics.jsonl", self.path(), title=out.name)


class Samples(Artifact):
    """RUN/sample_generations.json of a complete run (generation.generate_samples), and the same samples as
    metrics.jsonl's "samples" record (a table in the trackers): the demo's arithmetic prompts for the demo, else
    prompts that fit the corpus (its held-out chats' first questions, or openings of its held-out texts)."""

    name = "samples"
    files = (RunFile("sample_generations.json"),)

    def make(self, end: RunEnd) -> dict:
        if end.status != store.COMPLETE:
            return {}
        tokenizer = self.tokenizer()
        if tokenizer is None:
            return {}
        facts = self.ending.facts
        kind, prompts = (
            ("chat", generation.DEFAULT_PROMPTS)
            if (facts.corpus / "eval").is_dir()
            else self.attempt("sample_prompts", lambda: generation.held_out_prompts(facts.corpus, tokenizer))
            or ("chat", [])
        )
        samples = generation.generate_samples(
            self.ending.model,
            tokenizer,
            self.path(),
            prompts=prompts,
            step=end.step,
            text=kind == "text",
            sampling=facts.sampling,
        )
        if samples["error"]:
            self.errors["samples"] = samples["error"]
        self.ending.metrics.write_samples(samples)
        return {}


class HeldOutAccuracy(Artifact):
    """A complete run's exact-match accuracy on CORPUS/eval/ (evaluation.exact_match_accuracy; the demo's
    held-out problems): a line, run_status.json's `task_accuracy` and the model card's."""

    name = "task_accuracy"

    def make(self, end: RunEnd) -> dict:
        facts = self.ending.facts
        if end.status != store.COMPLETE or not (facts.corpus / "eval").is_dir():
            return {}
        tokenizer = self.tokenizer()
        if tokenizer is None:
            return {}
        accuracy = evaluation.exact_match_accuracy(self.ending.model, tokenizer, facts.corpus / "eval", facts.device)
        say(accuracy_line(accuracy))
        return {"task_accuracy": {key: accuracy[key] for key in ("accuracy", "correct", "total", "by_task")}}


class ModelExport(Artifact):
    """RUN/model/: the Hugging Face export with its model card and training_provenance.json (export_hf.py),
    the current weights whether the run is complete or stopped resumably (the card says which); the card
    carries what the artifacts before it found. run_status.json's `model_files` ({file: sha256})."""

    name = "export"
    files = (RunFile(export_hf.MODEL_DIR),)  # published as the repository itself (publishing.publish_layout)

    def make(self, end: RunEnd) -> dict:
        tokenizer = self.tokenizer()
        if tokenizer is None:
            return {}
        facts, model = self.ending.facts, self.ending.model
        info = export_hf.card_info(
            facts.out.name,
            end.status,
            facts.preset,
            end.step,
            end.total_steps,
            end.tokens,
            facts.settings,
            end.validation,
            end.test,
            self.ending.found.get("task_accuracy"),
            export_hf.usage_example_from(facts.corpus, tokenizer),
        )
        with attention.exportable(model):
            model_files = export_hf.export_hf_model(model, tokenizer, self.path(), info)
        scores = evaluation.kept_scores(facts.out, model_files.get("model.safetensors"))  # hashed by the export
        if scores is not None:
            card = export_hf.write_scores(self.path(), scores)
            model_files = {**model_files, "README.md": sha256_file(card)}
        return {"model_files": model_files, "model_dir": str(self.path())}


ARTIFACTS: tuple[type[Artifact], ...] = (LossCurve, Samples, HeldOutAccuracy, ModelExport)  # made in this order


def end_of_run(model, facts: RunFacts, metrics: metrics_log.MetricsLog, progress=None) -> list[Artifact]:
    """The artifacts of ARTIFACTS, sharing one Ending."""
    ending = Ending(model, facts, metrics, progress)
    return [artifact(ending) for artifact in ARTIFACTS]


def published_files() -> tuple[str, ...]:
    """The run files the artifacts declare published (publishing.PUBLISHED_RUN_FILES)."""
    return tuple(file.name for artifact in ARTIFACTS for file in artifact.files if file.published)


def accuracy_line(accuracy: dict) -> str:
    tasks = ", ".join(
        f"{name} {100 * task['accuracy']:.1f}% ({task['correct']}/{task['total']})"
        for name, task in accuracy["by_task"].items()
    )
    return (
        f"held-out task accuracy: {100 * accuracy['accuracy']:.1f}% ({accuracy['correct']}/{accuracy['total']})"
        f" | {tasks}"
    )


def make_from_checkpoint(
    checkpoint: dict, path: Path, out: Path, corpus: Path, sampling: generation.Sampling, device
) -> None:
    """`train.py --export-only`: the artifacts of the run `checkpoint` (read from `path`) ends, made in `out`
    as the run's own end at that step makes them (OUT/model/ always); the test loss is the one run_status.json
    has for the same step. Nothing is logged to metrics.jsonl; run_status.json keeps its status, its
    `model_files` follow the folder made (another step's export must not leave the old hashes standing)."""
    recorded = checkpoint["settings"]
    training = recorded["training"]
    manifest = corpus_format.load_manifest(corpus)
    if manifest.tokenizer_sha256 != training["tokenizer_sha256"]:
        raise UserError(
            f"the tokenizer of {corpus} is not the one checkpoint {path} was trained with; pass that corpus with --data"
        )
    model = model_config.build_model(
        model_config.recorded_preset(training), training["vocab_size"], manifest.special_tokens
    )
    model.load_state_dict(checkpoint["model"])
    model.to(device).eval()
    step, total = int(checkpoint["step"]), int(training["total_steps"])
    status = store.COMPLETE if step >= total else store.NEEDS_RESUME
    previous = read_json(out / store.STATUS_FILE) if (out / store.STATUS_FILE).is_file() else {}
    end = RunEnd(
        status,
        step,
        total,
        step * int(training["tokens_per_step"]),
        callbacks.Validation.saved(checkpoint["callbacks"]),
        previous.get("test") if previous.get("step") == step else None,
    )
    facts = RunFacts(out, corpus, training["preset"], recorded, sampling, device)
    metrics = metrics_log.MetricsLog(out / "metrics.jsonl", enabled=False)  # the run's history stays as it is
    found = callbacks.Callbacks(end_of_run(model, facts, metrics)).on_end(end)
    if not found.get("model_files"):
        errors = "; ".join(f"{name}: {why}" for name, why in (found.get("report_errors") or {}).items())
        raise UserError(f"--export-only: {out / export_hf.MODEL_DIR} not made ({errors or 'no reason given'})")
    store.RunStatus(out).amend(model_files=found["model_files"])  # nothing where the folder has no status
    print(
        f"exported {path} (step {step}/{total}, {status}) to {out / export_hf.MODEL_DIR}: "
        + ", ".join(
            f"{name} {sha[:12]}" for name, sha in found["model_files"].items() if name.endswith(".safetensors")
        ),
        flush=True,
    )
