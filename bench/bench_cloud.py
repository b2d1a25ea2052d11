"""Training throughput with checkpoint backups to a local S3 server against the same loop without.

    python bench/bench_cloud.py                      # synthetic CPU training loop, moto S3 server
    python bench/bench_cloud.py --pairs 16 --save-every 5 --batch 2048
    python bench/bench_cloud.py --target folder      # a local folder, as a mounted drive

A small torch model trains (forward, backward, AdamW) and saves a checkpoint every --save-every
steps as train.py does (temporary name, rename, keep the newest two). The run is cut into
checkpoint intervals (save, then --save-every steps) that alternate between the two kinds: without
backup, and with the checkpoint handed to checkpoint_cloud.BackupProcess (train.py's backup: a
reconcile loop in a child process), which uploads it to moto's S3 server (a separate process on
127.0.0.1) while the steps run, and deletes the local ones retention lets go once the remote holds
them. Each backed-up interval is compared with the plain one just before
it (this machine is shared: slow drifts cancel out) and the median of those ratios is reported,
with the process CPU time per step of each kind (less noisy than wall time).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from s3_server import free_port, start_s3_server  # noqa: E402

from tinyllm.common import ArgumentParser, atomic_path, sha256_file, utc_now  # noqa: E402
from tinyllm.store import (
    checkpoint_cloud,  # noqa: E402
    checkpoint_store,  # noqa: E402
    remote_store,  # noqa: E402
)


def parse_args() -> argparse.Namespace:
    parser = ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--pairs", type=int, default=16, help="checkpoint intervals of each kind, alternating")
    parser.add_argument("--save-every", type=int, default=5, help="optimizer steps per checkpoint interval")
    parser.add_argument("--width", type=int, default=512, help="hidden size of the synthetic model")
    parser.add_argument("--layers", type=int, default=6, help="layers of the synthetic model")
    parser.add_argument("--batch", type=int, default=2048, help="rows (tokens) per step")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (the machine is shared)")
    parser.add_argument(
        "--target",
        default="s3",
        choices=["s3", "folder"],
        help="back up to moto's S3 server, or to a local folder (a mounted drive)",
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="pin training to CPU 0 and the S3 server to the others (as if it ran elsewhere)",
    )
    return parser.parse_args()


def start_s3_store(pin: bool) -> subprocess.Popen:
    """moto's S3 server (bench/s3_server.py), with the AWS variables pointing at it."""
    port = free_port()
    server = start_s3_server(port, pin=pin)
    os.environ.update(
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}",
    )
    return server


class SyntheticTraining:
    """An MLP trained on a fixed batch, saving checkpoints like train.py."""

    def __init__(self, args: argparse.Namespace, folder: Path):
        torch.manual_seed(0)
        blocks = []
        for _ in range(args.layers):
            blocks += [torch.nn.Linear(args.width, args.width), torch.nn.GELU()]
        self.model = torch.nn.Sequential(*blocks, torch.nn.Linear(args.width, 1))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.inputs, self.targets = torch.randn(args.batch, args.width), torch.randn(args.batch, 1)
        self.folder = folder
        folder.mkdir(parents=True)
        self.step = 0
        self.saved: list[Path] = []

    def train_steps(self, count: int) -> None:
        for _ in range(count):
            loss = torch.nn.functional.mse_loss(self.model(self.inputs), self.targets)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            self.step += 1

    def save(self, backup: checkpoint_cloud.BackupProcess | None) -> None:
        path = self.folder / checkpoint_store.checkpoint_name(self.step)
        with atomic_path(path) as temp:  # the record before the rename, as train.py writes them
            torch.save(
                {
                    "format_version": 1,
                    "step": self.step,
                    "model": self.model.state_dict(),
                    "optimizer": self.optimizer.state_dict(),
                    "settings": {},
                },
                temp,
            )
            record = checkpoint_store.Record(
                path=path.name,
                step=self.step,
                sha256=sha256_file(temp),
                bytes=temp.stat().st_size,
                run_id="bench",
                created=utc_now(),
            )
            checkpoint_store.write_record(self.folder, record)
        checkpoint_store.write_record(self.folder, record, checkpoint_store.LATEST)
        self.saved.append(path)
        old = self.saved[:-2]
        if backup is not None:
            backup.submit(path, self.step)
            old = backup.deletable(old)
        gone = {Path(victim).name for victim in old}
        checkpoint_store.delete(self.folder, sorted(gone))
        self.saved = [path for path in self.saved if path.name not in gone]


def timed_interval(
    training: SyntheticTraining, save_every: int, backup: checkpoint_cloud.BackupProcess | None
) -> tuple[float, float]:
    """One checkpoint interval: (wall seconds, process CPU seconds)."""
    wall, cpu = time.perf_counter(), time.process_time()
    training.save(backup)
    training.train_steps(save_every)
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> int:
    args = parse_args()
    torch.set_num_threads(args.threads)
    if args.pin:
        os.sched_setaffinity(0, {0})
    server = start_s3_store(args.pin) if args.target == "s3" else None
    server_cpu = 0.0
    lines: list[str] = []
    plain, backed, waits = [], [], []
    try:
        with tempfile.TemporaryDirectory() as scratch:
            url = f"{scratch}/remote" if args.target == "folder" else "s3://bench/run"
            if args.target == "s3":
                remote_store.open_remote("s3://bench")[0].mkdir("bench")
            backup = checkpoint_cloud.BackupProcess(url, checkpoint_store.MirrorPolicy(keep_last=2), log=lines.append)
            training = SyntheticTraining(args, Path(scratch) / "run")
            training.train_steps(2)  # warm-up, and one backed-up save: the connection set-up is not measured
            training.save(backup)
            backup.wait(120)
            for _ in range(args.pairs):
                plain.append(timed_interval(training, args.save_every, None))
                backed.append(timed_interval(training, args.save_every, backup))
                started = time.perf_counter()
                if not backup.wait(120):  # normally already done: the upload ran during the steps
                    raise SystemExit("a checkpoint did not reach the server: " + lines[-1])
                waits.append(time.perf_counter() - started)
            backup.close()
            checkpoint_bytes = training.saved[-1].stat().st_size
    finally:
        if server is not None:
            server_cpu = sum(psutil.Process(server.pid).cpu_times()[:2])
            server.terminate()
            server.wait(10)
    ratios = [p_wall / b_wall for (p_wall, _), (b_wall, _) in zip(plain, backed)]
    steps_s = {
        kind: args.save_every / statistics.median(w for w, _ in runs)
        for kind, runs in (("plain", plain), ("backup", backed))
    }
    cpu_step = {
        kind: statistics.median(c for _, c in runs) / args.save_every
        for kind, runs in (("plain", plain), ("backup", backed))
    }
    interval = args.save_every / steps_s["plain"]
    ratio = statistics.median(ratios)
    print(
        f"target {args.target}; checkpoint {checkpoint_bytes / 1e6:.1f} MB every {args.save_every} steps "
        f"(every {interval:.1f}s, {checkpoint_bytes / 1e6 / interval:.1f} MB/s of training); {args.pairs} "
        f"intervals of each kind; {args.batch} rows/step, {args.threads} torch thread(s)"
    )
    print(
        f"median tokens/s: without backup {steps_s['plain'] * args.batch:,.0f}, "
        f"with backup {steps_s['backup'] * args.batch:,.0f}"
    )
    print(f"median process CPU s/step: without {cpu_step['plain']:.3f}, with backup {cpu_step['backup']:.3f}")
    print(
        f"wait for the upload after a backed-up interval (not timed): median {statistics.median(waits):.2f}s, "
        f"max {max(waits):.2f}s; upload failures logged: {sum('not backed up yet' in line for line in lines)}"
    )
    if server is not None:
        print(
            f"S3 server process CPU (a remote machine in real use): {server_cpu / args.pairs:.2f} s "
            "per checkpoint (start-up included), on this machine"
        )
    print(
        f"throughput ratio with backup / without (median of {len(ratios)} paired intervals): {ratio:.3f}x "
        f"(target >= 0.95x)"
    )
    return 0 if ratio >= 0.95 else 1


if __name__ == "__main__":
    raise SystemExit(main())
