"""What a person sees of a run: its progress and its final line; and the command line over a run's outputs.

metrics.jsonl and the loss curve are metrics_log.py's, the end-of-run outputs artifacts.py's, the Hugging
Face export and its model card export_hf.py's, generation (samples) generation.py's, scores evaluation.py's,
uploads publishing.py's; this module calls them, never the other way round.

train.py calls these on rank 0 (Progress takes `enabled=info.is_main`):

    progress = Progress(total_steps, initial_step=step, every=args.log_every, enabled=is_main)
    progress.update(step, loss, tokens_per_second, mfu)   # every optimizer step; progress.write(msg) for logs
    print(final_line(RUN, status, record))                 # the run's last line: where it stands, what next

Nothing runs at import time. The script form redraws a run's pictures or evaluates an
exported model after the fact:

    python report.py plot runs/demo                      # runs/demo/loss_curve.png from metrics.jsonl
    python report.py evaluate runs/demo --tasks corpus/demo/eval arc_easy --limit 200   # evaluation.py
    python report.py samples runs/demo/model --prompt "What is 12 plus 7?"              # generation.py
    python report.py samples runs/chat --system "Answer in one word." --prompt "Name a color."
    python report.py publish runs/demo hf://USER/REPO       # or a folder or store URL: verified (publishing.py)
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from tinyllm.common import (
    PROGRESS_WRITERS,
    ArgumentParser,
    UserError,
    checked_type,
    human_count,
    positive,
    run_main,
    say,
)
from tinyllm.model import generation, hardware
from tinyllm.outputs import evaluation, export_hf, metrics_log, publishing
from tinyllm.store import checkpoint_store as store

# ----------------------------------------------------------------------------------------------
# Progress: a tqdm bar on a terminal, a plain line every `every` steps in a log.


def stderr_is_terminal() -> bool:
    return hasattr(sys.stderr, "isatty") and sys.stderr.isatty()


class Progress:
    """Progress over optimizer steps, shown by rank 0 only.

    On a terminal: a tqdm bar (on stderr) with loss, tokens/s, MFU and tqdm's ETA. Otherwise
    (Kaggle log, pytest, `> log.txt`): a plain stdout line at the first update, every `every`
    steps and at the last step. `enabled=False` (other ranks) makes every method a no-op.
    `bar=None` picks the bar when stderr is a terminal; True/False forces it. `first_note` (e.g. the
    start-up compile time) goes with the first update.
    """

    def __init__(
        self,
        total_steps: int,
        initial_step: int = 0,
        every: int = 10,
        enabled: bool = True,
        bar: bool | None = None,
        first_note: str | None = None,
    ):
        self.total_steps = total_steps
        self.first_note = first_note
        self.initial_step = initial_step
        self.every = max(1, every)
        self.enabled = enabled
        self._first_update: tuple[int, float] | None = None  # (step, time): the pace is measured from here
        self._printed_any = False
        self._bar = None
        if enabled and (stderr_is_terminal() if bar is None else bar):
            from tqdm import tqdm

            # A fixed size: tqdm hides the bar on pseudo-terminals that report 0 rows (dynamic_ncols reads them).
            size = shutil.get_terminal_size((100, 24))
            self._bar = tqdm(
                total=total_steps,
                initial=initial_step,
                unit="step",
                desc="train",
                file=sys.stderr,
                ncols=size.columns,
                nrows=size.lines,
            )
            PROGRESS_WRITERS.append(self._write_above_bar)

    def update(self, step: int, loss: float, tokens_per_second: float | None = None, mfu: float | None = None) -> None:
        """Report that optimizer step `step` (1-based count of steps done) finished. `mfu` is a fraction."""
        if not self.enabled:
            return
        if self._first_update is None:
            self._first_update = step, time.monotonic()
        stats = format_stats(loss, tokens_per_second, mfu)
        if self.first_note:
            stats, self.first_note = f"{stats} | {self.first_note}", None
        if self._bar is not None:
            self._bar.set_postfix_str(stats, refresh=False)
            self._bar.update(step - self._bar.n)
            return
        due = step % self.every == 0 or step >= self.total_steps or not self._printed_any
        if due:
            self._printed_any = True
            width = len(str(self.total_steps))
            percent = 100.0 * step / max(1, self.total_steps)
            line = f"step {step:>{width}}/{self.total_steps} ({percent:5.1f}%) | {stats} | ETA {self.eta(step)}"
            print(line, flush=True)

    def set_total(self, total_steps: int) -> None:
        """The run's length changed under way (a --budget re-plan: budget.check_plan)."""
        self.total_steps = total_steps
        if self._bar is not None:
            self._bar.total = total_steps
            self._bar.refresh()

    def eta(self, step: int) -> str:
        """Time left at the average pace since the first update (tqdm's own format); "?" until a second one.

        Why from the first update: the first step carries one-off costs (torch.compile, memory, caches)
        that would otherwise make the early estimates far too long."""
        from tqdm import tqdm

        if self._first_update is None or step <= self._first_update[0]:
            return "?"
        first_step, first_time = self._first_update
        seconds = (time.monotonic() - first_time) / (step - first_step) * max(0, self.total_steps - step)
        return tqdm.format_interval(seconds)

    def write(self, message: str) -> None:
        """Print a message (an eval result, a checkpoint) without breaking the bar (common.say)."""
        say(message, main=self.enabled)

    def _write_above_bar(self, text: str, warning: bool) -> None:
        self._bar.write(text, file=sys.stderr)

    def close(self) -> None:
        if self._bar is not None:
            PROGRESS_WRITERS.remove(self._write_above_bar)
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def format_stats(loss: float, tokens_per_second: float | None, mfu: float | None) -> str:
    parts = [f"loss {loss:.4f}"]
    if tokens_per_second is not None:
        parts.append(f"{human_count(tokens_per_second)} tok/s")
    if mfu is not None:
        parts.append(f"MFU {100 * mfu:.1f}%")
    return " | ".join(parts)


# ----------------------------------------------------------------------------------------------
# The last line of a run.


def final_line(out: Path, status: str, record: dict) -> str:
    """The last line a person sees: where the run stands and what to do next."""
    line = f"{status}: step {record['step']}/{record['total_steps']}"
    if record.get("backup_complete") is not None:
        line += " | newest checkpoint " + ("backed up" if record["backup_complete"] else "NOT yet backed up")
    if status == store.NEEDS_RESUME:
        why = f" | {record['reason']}" if record.get("reason") else ""  # e.g. stopped by --max-hours budget
        return line + f"{why} | continue with: {record['resume_command']}"
    if record.get("test_loss") is not None:
        line += f" | test loss {record['test_loss']:.4f}{metrics_log.bits_per_byte_text(record.get('test') or {})}"
    elif (record.get("validation") or {}).get("loss") is not None:
        line += f" | validation loss {record['validation']['loss']:.4f} (no test split)"
    elif record.get("train_loss") is not None:
        line += f" | train loss {record['train_loss']:.4f} (no held-out split)"
    for name, scores in (record.get("tasks") or {}).items():
        at = f" at step {record['tasks_step']}" if record.get("tasks_step") not in (None, record["step"]) else ""
        line += f" | {name} acc {scores['acc']:.3f}{at} (chance {scores['chance']:.3f})"
    if record.get("task_accuracy"):
        line += f" | held-out accuracy {100 * record['task_accuracy']['accuracy']:.1f}%"
    if record.get("model_files"):
        line += f" | model: {out / 'model'} (sha256 in {out / 'run_status.json'})"
    missing = [name for name, state in (record.get("outputs") or {}).items() if state in ("pending", "failed")]
    if missing and record.get("report_command"):
        made = "model/ not made" if "model" in missing else "report incomplete"
        failed = ", ".join(record.get("report_errors") or {}) or "not made yet"
        line += (
            f" | {made} ({failed}: report_errors in {out / 'run_status.json'}) | make it again with: "
            f"{record['report_command']}"
        )
    return line


# ----------------------------------------------------------------------------------------------
# Command line: redraw a run's curve, evaluate, sample or publish an exported model.

count = checked_type(int, positive)  # --max-new-tokens, --batch-size: 0 is refused at parse time


DEVICES = ["cpu", *hardware.ACCELERATORS]  # the accelerators check_device knows


def add_device_arg(parser: argparse.ArgumentParser) -> None:
    """--device of evaluate and samples: torch must see it (main checks, as train.py does)."""
    parser.add_argument("--device", default="cpu", choices=DEVICES, help="where the model runs")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    plot = commands.add_parser(
        "plot",
        help="redraw RUN/loss_curve.png from RUN/metrics.jsonl",
    )
    plot.add_argument("run", help="run folder holding metrics.jsonl")
    plot.add_argument("--out", help="PNG to write (default: RUN/loss_curve.png)")
    evaluate = commands.add_parser(
        "evaluate",
        help="benchmark scores of an exported model (lm-eval tasks, local multiple-choice and exact-match task files)",
    )
    evaluate.add_argument("model", help="run folder (RUN, scores go to RUN/eval/ and the model card) or RUN/model")
    evaluate.add_argument(
        "--tasks",
        nargs="+",
        required=True,
        help="lm-eval task names (hellaswag, arc_easy, ...), task .jsonl files or folders of them",
    )
    evaluate.add_argument("--limit", type=int, help="score a seeded subsample of N items per task")
    evaluate.add_argument("--seed", type=int, default=evaluation.DEFAULT_SEED, help="seed of the --limit subsample")
    evaluate.add_argument("--batch-size", type=count, default=32, help="items scored at once")
    evaluate.add_argument("--max-new-tokens", type=count, default=96, help="reply length of exact-match tasks")
    add_device_arg(evaluate)
    evaluate.add_argument("--json", help="also write the scores to this JSON file")
    samples = commands.add_parser(
        "samples",
        help="chat replies (or --text continuations) of an exported model",
    )
    samples.add_argument("model", help="run folder (RUN) or its exported model folder (RUN/model)")
    samples.add_argument(
        "--prompt",
        action="append",
        help="a user prompt (repeatable; default: the prompts of the run's sample_generations.json beside the "
        "model folder, held out from its corpus, else built-in ones)",
    )
    samples.add_argument(
        "--text",
        action="store_true",
        help="continue each --prompt as plain text (a model trained on plain text, e.g. books)",
    )
    samples.add_argument(
        "--system",
        help="a system turn put before each prompt, rendered as data.py renders a training chat's (not with --text)",
    )
    samples.add_argument("--max-new-tokens", type=count, default=96, help="longest reply, in tokens")
    generation.add_sampling_args(samples)
    add_device_arg(samples)
    publish = commands.add_parser(
        "publish",
        help="upload RUN's model, GGUF files, card, settings and loss "
        f"curve to hf://USER/REPO or {publishing.STORES_TEXT}, verified",
    )
    publish.add_argument("run", help="run folder holding model/ (and any GGUF files export_gguf.py wrote)")
    publish.add_argument(
        "url", help=f"hf://USER/REPO (a model repository, created private), or {publishing.STORES_TEXT}"
    )
    publish.add_argument("--public", action="store_true", help="hf://: create the repository public")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "plot":
        if not Path(args.run).is_dir():
            raise UserError(f"run {args.run}: no such folder")
        out = args.out or str(Path(args.run) / "loss_curve.png")
        if not metrics_log.plot_loss_curve(Path(args.run) / "metrics.jsonl", out, title=Path(args.run).name):
            raise UserError(f"no loss records in {Path(args.run) / 'metrics.jsonl'}")
        print(f"wrote {out}")
    elif args.command == "evaluate":
        hardware.check_device(args.device)
        result = evaluation.evaluate(
            args.model, args.tasks, args.limit, args.batch_size, args.device, args.seed, args.max_new_tokens
        )
        written = evaluation.write_outputs(result, args.json)
        print(export_hf.score_table(result))
        print(f"settings: {export_hf.settings_line(result['harness'])}")
        print("wrote " + ", ".join(str(path) for path in written))
    elif args.command == "publish":
        where = publishing.publish(args.run, args.url, args.public)
        print(f"published {len(publishing.publish_layout(Path(args.run)))} files of {args.run} to {where} (verified)")
    else:
        print_samples(args)
    return 0


def print_samples(args: argparse.Namespace) -> None:
    """`report.py samples`: each prompt and the exported model's reply (with --text, its continuation)."""
    hardware.check_device(args.device)
    model_dir, run = evaluation.model_and_run(args.model)
    samples_file = (run or model_dir.parent) / "sample_generations.json"  # the run's: prompts of its corpus
    recorded = None if args.prompt else generation.recorded_prompts(samples_file)
    text, prompts = generation.sample_prompts(args.prompt, args.text, recorded)
    conversations = sample_conversations(prompts, args.system, text)
    sampling = generation.sampling_from(vars(args))
    model, tokenizer = generation.load_exported(str(model_dir), args.device)
    if recorded is not None:
        print(f"prompts: the {'text openings' if text else 'questions'} of the run's {samples_file} (its corpus')\n")
    if text:
        details = generation.generate_text_details(
            model, tokenizer, prompts, args.max_new_tokens, args.device, sampling
        )
        for prompt, detail in zip(prompts, details):
            print(f"> {prompt}{detail['completion']}\n")
        return
    if args.system is not None:
        print(f"system: {args.system}\n")
    replies = generation.generate_chat(
        model, tokenizer, conversations, args.max_new_tokens, args.device, sampling=sampling
    )
    for prompt, reply in zip(prompts, replies):
        print(f"> {prompt}\n{reply}\n")


def sample_conversations(prompts: list[str], system: str | None, text: bool) -> list[list[dict]]:
    """Each prompt as the conversation `samples` answers: a user turn, after the --system turn where one is given.

    --system has no meaning where the prompts are continued as plain text (--text, or a run trained on plain
    text), nor empty."""
    if system is None:
        return [generation.as_messages(prompt) for prompt in prompts]
    if text:
        raise UserError(
            "samples --system is a chat model's system turn, but these prompts are continued as plain text "
            "(--text, or a run whose sample_generations.json holds text openings); leave out --system"
        )
    if not system.strip():
        raise UserError("samples --system is empty; leave it out for prompts without a system turn")
    return [[{"role": "system", "content": system}, *generation.as_messages(prompt)] for prompt in prompts]


def command() -> None:
    """The `tinyllm-report` console script (pyproject.toml): `python report.py` from anywhere."""
    run_main(main, script=True)


if __name__ == "__main__":
    run_main(main)
