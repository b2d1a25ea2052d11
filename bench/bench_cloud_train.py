"""Training throughput of train.py with checkpoint backup to S3 against the same run without it.

    python bench/bench_cloud_train.py                       # nano preset, save every 5 steps, 4 pairs
    python bench/bench_cloud_train.py --preset micro --batch-size 4 --save-every 10 --steps 40

Runs train.py as a subprocess on the demo corpus (built once with `data.py --demo`, or --corpus),
in pairs of runs that differ only in `--backup-to s3://...`, alternating which goes first. The S3
store is moto's server on 127.0.0.1, started at nice 19: in real use the store is another machine,
here it competes for the same cores, so the lowest priority is the closest stand-in we have.

Two figures per run, from the train lines of metrics.jsonl (--log-every 1), skipping the first
--skip-steps steps:
  step tok/s   median of `tokens_per_second`: the optimizer step's own time (a save is not in it,
               so this shows only the backup process / server competing for the CPU);
  wall tok/s   tokens trained between the first and the last counted step, divided by the wall
               time between the two lines appearing in metrics.jsonl (polled here every 20 ms,
               since the file's timestamps are to the second): includes the checkpoint saves and
               everything the backup costs the training process. This is the headline figure.
  CPU tok/s    the same tokens divided by the training process's CPU seconds (all its threads,
               from /proc) over the same window: steadier than wall time on a loaded machine; it
               counts the backup's own CPU work but not the server's, nor waiting for the CPU.
The ratio is backed-up / plain per pair; the result is the median over pairs against --target.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from s3_server import free_port, start_s3_server  # noqa: E402

from tinyllm.common import ArgumentParser  # noqa: E402
from tinyllm.store import remote_store  # noqa: E402  (after the path: the bench runs as a script from anywhere)

POLL_SECONDS = 0.02


def parse_args() -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument(
        "--corpus",
        type=Path,
        default=None,
        help="a corpus built by data.py (None: build the demo corpus in the work folder)",
    )
    parser.add_argument("--work", type=Path, default=None, help="work folder (None: a temporary one, removed)")
    parser.add_argument("--preset", default="nano", help="train.py --preset")
    parser.add_argument("--batch-size", type=int, default=8, help="train.py --batch-size")
    parser.add_argument("--grad-accum", type=int, default=1, help="train.py --grad-accum")
    parser.add_argument("--save-every", type=int, default=5, help="train.py --save-every (steps)")
    parser.add_argument("--steps", type=int, default=60, help="train.py --stop-after-steps")
    parser.add_argument("--skip-steps", type=int, default=5, help="steps left out of the figures (warm-up)")
    parser.add_argument("--pairs", type=int, default=4, help="pairs of runs (plain, backed up), order alternating")
    parser.add_argument("--threads", type=int, default=1, help="train.py --threads")
    parser.add_argument("--target", type=float, default=0.95, help="ratio backed-up / plain to meet")
    args = parser.parse_args()
    if args.steps <= args.skip_steps + 1:
        parser.error(f"--steps {args.steps} must be more than --skip-steps + 1 ({args.skip_steps + 1})")
    return args


# ----------------------------------------------------------------------------------------------
# The stand-in S3 store.


def s3_environment(endpoint: str, work: Path) -> dict[str, str]:
    """The variables s3fs / botocore read: fake credentials, the local endpoint, no user config."""
    env = {
        name: value
        for name, value in os.environ.items()
        if name not in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3")
    }
    env.update(
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL=endpoint,
        AWS_CONFIG_FILE=str(work / "no-aws-config"),
        AWS_SHARED_CREDENTIALS_FILE=str(work / "no-aws-credentials"),
    )
    return env


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ----------------------------------------------------------------------------------------------
# One train.py run.


@dataclass
class Run:
    label: str
    seconds: float = 0.0  # the whole process
    arrivals: dict[int, float] = field(default_factory=dict)  # step -> monotonic time its line appeared
    step_tps: dict[int, float] = field(default_factory=dict)  # step -> tokens_per_second
    cpu: dict[int, float] = field(default_factory=dict)  # step -> process CPU seconds when its line appeared
    tokens_per_step: int = 0

    def counted_steps(self, skip: int) -> list[int]:
        return sorted(step for step in self.arrivals if step > skip)

    def step_tokens_per_second(self, skip: int) -> float:
        return statistics.median(self.step_tps[step] for step in self.counted_steps(skip))

    def wall_tokens_per_second(self, skip: int) -> float:
        steps = self.counted_steps(skip)
        first, last = steps[0], steps[-1]
        return (last - first) * self.tokens_per_step / (self.arrivals[last] - self.arrivals[first])

    def cpu_tokens_per_second(self, skip: int) -> float:
        steps = self.counted_steps(skip)
        first, last = steps[0], steps[-1]
        return (last - first) * self.tokens_per_step / (self.cpu[last] - self.cpu[first])


def read_new_train_lines(path: Path, offset: int, run: Run, pid: int | None) -> int:
    """Parse complete lines added to metrics.jsonl since offset; returns the new offset."""
    if not path.exists():
        return offset
    with open(path, "rb") as handle:
        handle.seek(offset)
        chunk = handle.read()
    now = time.monotonic()
    cpu = process_cpu_seconds(pid) if pid is not None else None
    end = chunk.rfind(b"\n") + 1
    for line in chunk[:end].splitlines():
        record = json.loads(line)
        if record.get("kind") == "train":
            step = int(record["step"])
            run.arrivals[step] = now
            if cpu is not None:
                run.cpu[step] = cpu
            run.step_tps[step] = float(record["tokens_per_second"])
            run.tokens_per_step = int(record["tokens"]) // step
    return offset + end


def train_command(args: argparse.Namespace, corpus: Path, out: Path, backup_url: str | None) -> list[str]:
    command = [
        sys.executable,
        str(ROOT / "train.py"),
        "--data",
        str(corpus),
        "--out",
        str(out),
        "--preset",
        args.preset,
        "--batch-size",
        str(args.batch_size),
        "--grad-accum",
        str(args.grad_accum),
        "--save-every",
        str(args.save_every),
        "--stop-after-steps",
        str(args.steps),
        "--target-tokens",
        str(100 * args.steps * args.batch_size * args.grad_accum * 4096),
        "--eval-every",
        "0",
        "--log-every",
        "1",
        "--save-seconds",
        "100000",
        "--no-report",
        "--threads",
        str(args.threads),
    ]
    if backup_url:
        command += ["--backup-to", backup_url]
    return command


def run_train(args: argparse.Namespace, label: str, command: list[str], out: Path, env: dict[str, str]) -> Run:
    run = Run(label)
    metrics_path = out / "metrics.jsonl"
    log_path = out.with_suffix(".log")
    offset = 0
    started = time.monotonic()
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        while process.poll() is None:
            try:
                offset = read_new_train_lines(metrics_path, offset, run, process.pid)
            except FileNotFoundError:  # the process ended between poll() and reading /proc
                break
            time.sleep(POLL_SECONDS)
    run.seconds = time.monotonic() - started
    process.wait()
    read_new_train_lines(metrics_path, offset, run, None)
    if process.returncode != 0:
        tail = log_path.read_text(errors="replace")[-2000:]
        raise SystemExit(f"{label}: train.py exited with {process.returncode}; log {log_path}:\n{tail}")
    if len([step for step in run.counted_steps(args.skip_steps) if step in run.cpu]) < 2:
        raise SystemExit(f"{label}: too few train lines in {metrics_path}")
    return run


# ----------------------------------------------------------------------------------------------


def main() -> int:
    args = parse_args()
    temporary = tempfile.TemporaryDirectory(prefix="bench_cloud_train-") if args.work is None else None
    work = Path(temporary.name) if temporary else args.work
    work.mkdir(parents=True, exist_ok=True)
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs")

    corpus = args.corpus
    if corpus is None:
        corpus = work / "corpus"
        if not corpus.exists():
            print("building the demo corpus ...", flush=True)
            subprocess.run(
                [sys.executable, str(ROOT / "data.py"), "--demo", "--out", str(corpus), "--no-progress"],
                check=True,
                stdout=subprocess.DEVNULL,
                cwd=ROOT,
            )

    port = free_port()
    env = s3_environment(f"http://127.0.0.1:{port}", work)
    os.environ.update({name: env[name] for name in env if name.startswith("AWS_")})
    server = start_s3_server(port, work / "moto.log")
    try:
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        fs, _ = remote_store.open_remote(f"s3://{bucket}")
        fs.mkdir(bucket)
        pairs = []
        server_cpu = 0.0
        for pair in range(args.pairs):
            runs = {}
            for backed_up in (False, True) if pair % 2 == 0 else (True, False):
                label = f"pair {pair + 1} {'backup' if backed_up else 'plain '}"
                out = work / f"run-{pair + 1}-{'backup' if backed_up else 'plain'}"
                url = f"s3://{bucket}/run-{pair + 1}" if backed_up else None
                cpu_before = process_cpu_seconds(server.pid)
                run = run_train(args, label, train_command(args, corpus, out, url), out, env)
                if backed_up:
                    server_cpu += process_cpu_seconds(server.pid) - cpu_before
                    remote = len([name for name in fs.find(url) if name.endswith(".pt")])
                    extra = f" | {remote} .pt on the remote"
                else:
                    extra = ""
                print(
                    f"{label}: step {run.step_tokens_per_second(args.skip_steps):8.0f} tok/s | wall "
                    f"{run.wall_tokens_per_second(args.skip_steps):8.0f} tok/s | CPU "
                    f"{run.cpu_tokens_per_second(args.skip_steps):8.0f} tok/s | process {run.seconds:5.1f} s"
                    f"{extra}",
                    flush=True,
                )
                runs[backed_up] = run
            pairs.append(runs)
    finally:
        server.terminate()
        server.wait(timeout=30)

    plain = pairs[0][False]
    checkpoint = sorted((work / "run-1-plain" / "checkpoints").glob("step-*.pt"))
    size = f"{checkpoint[-1].stat().st_size / 1e6:.1f} MB" if checkpoint else "?"
    counted = plain.counted_steps(args.skip_steps)
    interval = (plain.arrivals[counted[-1]] - plain.arrivals[counted[0]]) / (counted[-1] - counted[0])
    print(
        f"\n{args.preset}: {plain.tokens_per_step} tokens/step, checkpoint {size} every {args.save_every} steps "
        f"(~{interval * args.save_every:.1f} s apart plain); steps {args.skip_steps + 1}-{args.steps} counted"
    )
    step_ratios = [
        p[True].step_tokens_per_second(args.skip_steps) / p[False].step_tokens_per_second(args.skip_steps)
        for p in pairs
    ]
    wall_ratios = [
        p[True].wall_tokens_per_second(args.skip_steps) / p[False].wall_tokens_per_second(args.skip_steps)
        for p in pairs
    ]
    cpu_ratios = [
        p[True].cpu_tokens_per_second(args.skip_steps) / p[False].cpu_tokens_per_second(args.skip_steps) for p in pairs
    ]
    process_ratios = [p[False].seconds / p[True].seconds for p in pairs]
    for pair, (step, wall, cpu, whole) in enumerate(zip(step_ratios, wall_ratios, cpu_ratios, process_ratios), 1):
        print(
            f"pair {pair}: backup / plain  wall tok/s {wall:.3f}x | step tok/s {step:.3f}x | CPU tok/s {cpu:.3f}x"
            f" | process time (plain / backup) {whole:.3f}x"
        )
    median = statistics.median(wall_ratios)
    verdict = "met" if median >= args.target else "NOT met"
    print(
        f"median wall tok/s ratio {median:.3f}x (target >= {args.target:.2f}x: {verdict}); "
        f"median step tok/s ratio {statistics.median(step_ratios):.3f}x; "
        f"median CPU tok/s ratio {statistics.median(cpu_ratios):.3f}x"
    )
    saves = args.pairs * (args.steps // args.save_every)
    print(
        f"moto server (nice 19): {server_cpu:.1f} CPU-s during the backed-up runs, "
        f"{server_cpu / saves:.2f} CPU-s per checkpoint"
    )
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if temporary:
        temporary.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
