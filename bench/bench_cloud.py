"""Training throughput with checkpoint backups to a local S3 server against the same loop without.

    python bench/bench_cloud.py                      # synthetic CPU training loop, moto S3 server
    python bench/bench_cloud.py --steps 120 --save-every 10 --repeats 3

A small torch model trains (forward, backward, AdamW) and saves a checkpoint every --save-every
steps, exactly as train.py does (temporary name, rename, keep the newest two). The backup run also
hands each checkpoint to checkpoint_cloud.CheckpointBackup, which uploads it to moto's S3 server
(a separate process on 127.0.0.1) and lets local retention delete only backed-up files. Runs
alternate (baseline, backup, baseline, ...) and the median steps/s of each are compared. The final
wait for the last upload happens after the timed loop and is reported on its own, as is the
process CPU time per step (less noisy than wall time on a shared machine).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import checkpoint_cloud  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--steps", type=int, default=120, help="optimizer steps per run")
    parser.add_argument("--save-every", type=int, default=10, help="checkpoint every N steps")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each kind, alternating")
    parser.add_argument("--width", type=int, default=512, help="hidden size of the synthetic model")
    parser.add_argument("--layers", type=int, default=6, help="layers of the synthetic model")
    parser.add_argument("--batch", type=int, default=64, help="rows per step")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (the machine is shared)")
    return parser.parse_args()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_s3_server() -> tuple[subprocess.Popen, str]:
    """moto's S3 server as its own process, with the AWS variables pointing at it."""
    port = free_port()
    # In real use the store is another machine: the stand-in runs at the lowest CPU priority.
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=lambda: os.nice(19))
    endpoint = f"http://127.0.0.1:{port}"
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL=endpoint)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return server, endpoint
        except OSError:
            time.sleep(0.2)
    server.kill()
    raise SystemExit("moto server did not start")


def build_model(width: int, layers: int) -> torch.nn.Module:
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*blocks, torch.nn.Linear(width, 1))


def train(args: argparse.Namespace, folder: Path,
          backup: checkpoint_cloud.CheckpointBackup | None) -> tuple[float, float]:
    """Run the loop; returns (steps per second, process CPU seconds per step) of the timed part."""
    torch.manual_seed(0)
    model = build_model(args.width, args.layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inputs, targets = torch.randn(args.batch, args.width), torch.randn(args.batch, 1)
    folder.mkdir(parents=True)
    if backup is not None:
        backup.started.wait(60)  # its one-time connection set-up is not part of the per-checkpoint cost
    saved: list[Path] = []
    started, cpu_started = time.perf_counter(), time.process_time()
    for step in range(1, args.steps + 1):
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % args.save_every == 0:
            path = folder / f"step-{step:08d}.pt"
            temp = path.with_suffix(".pt.partial")
            torch.save({"format_version": 1, "step": step, "model": model.state_dict(),
                        "optimizer": optimizer.state_dict(), "settings": {}}, temp)
            temp.replace(path)
            saved.append(path)
            old = saved[:-2]
            if backup is not None:
                backup.submit(path, step)
                old = backup.deletable(old)
            for victim in old:
                victim.unlink()
                saved.remove(victim)
    return args.steps / (time.perf_counter() - started), (time.process_time() - cpu_started) / args.steps


def main() -> int:
    args = parse_args()
    torch.set_num_threads(args.threads)
    server, _ = start_s3_server()
    lines: list[str] = []
    try:
        with tempfile.TemporaryDirectory() as scratch:
            fs, _ = checkpoint_cloud.open_remote("s3://bench")
            fs.mkdir("bench")
            baseline, backed, waits = [], [], []
            for repeat in range(args.repeats):
                baseline.append(train(args, Path(scratch) / f"plain-{repeat}", None))
                backup = checkpoint_cloud.CheckpointBackup(f"s3://bench/run-{repeat}", save_every=args.save_every,
                                                           log=lines.append)
                backed.append(train(args, Path(scratch) / f"backup-{repeat}", backup))
                started = time.perf_counter()
                if not backup.wait(120):
                    raise SystemExit("the last checkpoint did not reach the server: " + lines[-1])
                waits.append(time.perf_counter() - started)
                backup.close()
                print(f"repeat {repeat}: baseline {baseline[-1][0]:.3f} steps/s, with backup {backed[-1][0]:.3f} "
                      "steps/s", flush=True)
            checkpoint_bytes = max(p.stat().st_size for p in (Path(scratch) / "backup-0").glob("*.pt"))
    finally:
        server.terminate()
        server.wait(10)
    kinds = {"plain": baseline, "backup": backed}
    speed = {kind: statistics.median(run[0] for run in runs) for kind, runs in kinds.items()}
    cpu = {kind: statistics.median(run[1] for run in runs) for kind, runs in kinds.items()}
    ratio = speed["backup"] / speed["plain"]
    failures = [line for line in lines if "not backed up yet" in line]
    seconds_between = args.save_every / speed["plain"]
    print(f"checkpoint {checkpoint_bytes / 1e6:.1f} MB every {args.save_every} steps (every {seconds_between:.1f}s, "
          f"{checkpoint_bytes / 1e6 / seconds_between:.1f} MB/s of training), {args.steps} steps x {args.repeats} "
          f"repeats, {args.threads} torch thread(s), {args.batch} rows per step")
    print(f"median steps/s: baseline {speed['plain']:.3f}, with backup {speed['backup']:.3f}")
    print(f"median process CPU s/step: baseline {cpu['plain']:.3f}, with backup {cpu['backup']:.3f} "
          f"(backup work ~{(cpu['backup'] - cpu['plain']) * args.save_every:.2f} CPU s per checkpoint)")
    print(f"throughput ratio with backup / without: {ratio:.3f}x (target >= 0.95x)")
    print(f"final wait for the last upload after the loop: median {statistics.median(waits):.2f}s; "
          f"upload failures logged: {len(failures)}")
    return 0 if ratio >= 0.95 else 1


if __name__ == "__main__":
    raise SystemExit(main())
