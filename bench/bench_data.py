"""Corpus building speed and memory: data.py vs a `datasets` pipeline vs bare `encode_batch`.

    python bench/bench_data.py --mb 200              # the issue's benchmark (several minutes on 2 cores)
    python bench/bench_data.py --mb 20 --scale 10    # also checks that peak RSS does not grow with input

One run generates a synthetic English-like JSONL corpus (no downloads), trains one BPE
tokenizer on a sample of it, then tokenizes the same text three ways, each in its own
process so peak RSS is that method's alone:

- `data.py`: the real builder (`--tokenizer` reuse), end to end: read, clean, dedup,
  split, tokenize, write shards and manifests; `data.py-pool` is the same with
  `--tokenize-workers N` (a process pool of single-threaded tokenizers instead of the Rust
  tokenizer's own threads).
- `datasets`: what a user would otherwise write: Dataset.from_generator ->
  map(tokenize, batched=True, num_proc=N) -> map(group into fixed blocks).
- `bare`: `Tokenizer.encode_batch_fast` over texts already in memory (the practical limit).

Ratios are printed against `bare` measured in the same run, both for wall-clock tokens/s
and for tokens per CPU-second (user + system time of the process, its threads and its
worker processes): on a shared, loaded machine wall time swings 2x between runs while CPU
time stays put, so the second ratio is the stable one there.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tinyllm.common import ArgumentParser  # noqa: E402
from tinyllm.data import build as data  # noqa: E402
from tinyllm.data import corpus_format  # noqa: E402

SYLLABLES = [
    "ka",
    "lo",
    "mi",
    "ne",
    "ra",
    "to",
    "su",
    "vi",
    "pe",
    "do",
    "an",
    "er",
    "in",
    "on",
    "th",
    "st",
    "re",
    "al",
    "or",
    "en",
    "qu",
    "sh",
    "ch",
    "ly",
    "ing",
    "ed",
    "es",
    "ti",
    "ma",
    "co",
    "bu",
    "gra",
    "fi",
    "ze",
    "hu",
    "wo",
    "ple",
    "tion",
    "ous",
    "ment",
    "ab",
    "ex",
    "un",
    "dis",
    "pro",
    "com",
    "ver",
    "lat",
    "gen",
    "mon",
    "tri",
    "sol",
    "cap",
    "dur",
    "fer",
    "nov",
    "pul",
    "rad",
    "sig",
    "tem",
]


def generate_corpus(path: Path, megabytes: float, seed: int = 0) -> int:
    """Write `megabytes` of JSONL text documents (Zipf-distributed pseudo-words, numbers, punctuation)."""
    rng = np.random.default_rng(seed)
    words = sorted({"".join(rng.choice(SYLLABLES, size=rng.integers(1, 5))) for _ in range(150_000)})
    words = np.array(words)
    rng.shuffle(words)  # frequency rank independent of spelling
    target, written, documents = int(megabytes * 1e6), 0, 0
    with open(path, "w", encoding="utf-8") as handle:
        while written < target:
            chunk = []
            for _ in range(500):
                count = int(rng.integers(40, 900))
                picks = words[np.minimum(rng.zipf(1.1, size=count), len(words)) - 1]
                sentence_ends = rng.random(count) < 0.08
                pieces = [f"{word}." if end else str(word) for word, end in zip(picks, sentence_ends)]
                pieces.append(f"In {int(rng.integers(1800, 2030))} there were {int(rng.integers(0, 10**6))}.")
                chunk.append(json.dumps({"text": " ".join(pieces).capitalize(), "id": documents}) + "\n")
                documents += 1
            block = "".join(chunk)
            handle.write(block)
            written += len(block.encode("utf-8"))
    return documents


def peak_rss_mb() -> tuple[float, float]:
    """(peak RSS of this process, of its largest finished child process) in MB."""
    import resource

    return (
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
    )


def cpu_seconds() -> float:
    """User + system CPU time of this process (all threads) and its finished child processes."""
    import resource

    return sum(
        usage.ru_utime + usage.ru_stime
        for usage in (resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN))
    )


# ----------------------------------------------------------------------------------------------
# The three methods; each runs as `python bench_data.py --method NAME ...` in its own process.


def method_data_py(args) -> dict:

    workers = args.num_proc if args.method == "data.py-pool" else 0
    settings = data.BuildSettings(tokenizer=args.tokenizer, progress=False, tokenize_workers=workers)
    out = Path(args.out)
    data.build_corpus(data.resolve_inputs([args.input]), out, settings, overwrite=True)
    manifest = corpus_format.load_manifest(out)
    return {
        "tokens": manifest.tokens,
        "documents": manifest.documents,
        "disk_mb": sum(p.stat().st_size for p in out.rglob("*") if p.is_file()) / 1e6,
    }


def read_texts(path: str):
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            yield json.loads(line)["text"]


def method_datasets(args) -> dict:
    import datasets
    from transformers import AutoTokenizer

    datasets.disable_progress_bars()
    cache = Path(args.out) / "hf_cache"
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    eos = tokenizer.eos_token
    block = 1024

    def tokenize(batch):
        return tokenizer([text + eos for text in batch["text"]], add_special_tokens=False)

    def group(batch):
        ids = [token for row in batch["input_ids"] for token in row]
        total = len(ids) // block * block
        return {"input_ids": [ids[i : i + block] for i in range(0, total, block)]}

    dataset = datasets.Dataset.from_generator(
        lambda: ({"text": text} for text in read_texts(args.input)), cache_dir=str(cache)
    )
    dataset = dataset.map(tokenize, batched=True, num_proc=args.num_proc, remove_columns=["text"])
    tokens = sum(len(row) for row in dataset["input_ids"])  # counted before grouping drops the tail
    dataset = dataset.map(group, batched=True, num_proc=args.num_proc, remove_columns=dataset.column_names)
    return {
        "tokens": tokens,
        "blocks": len(dataset),
        "cache_mb": sum(p.stat().st_size for p in cache.rglob("*") if p.is_file()) / 1e6,
    }


def method_bare(args) -> dict:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(args.tokenizer) / "tokenizer.json"))
    texts = list(read_texts(args.input))
    started, cpu_started = time.perf_counter(), cpu_seconds()
    tokens, batch = 0, []
    size = 0
    for text in texts:
        batch.append(text)
        size += len(text)
        if size >= 4_000_000:
            tokens += sum(len(e.ids) + 1 for e in tokenizer.encode_batch_fast(batch, add_special_tokens=False))
            batch, size = [], 0
    if batch:
        tokens += sum(len(e.ids) + 1 for e in tokenizer.encode_batch_fast(batch, add_special_tokens=False))
    return {
        "tokens": tokens,
        "encode_seconds": time.perf_counter() - started,
        "encode_cpu_seconds": cpu_seconds() - cpu_started,
    }


METHODS = {"data.py": method_data_py, "data.py-pool": method_data_py, "datasets": method_datasets, "bare": method_bare}


def run_method(name: str, input_path: Path, tokenizer: Path, out: Path, num_proc: int) -> dict:
    command = [
        sys.executable,
        __file__,
        "--method",
        name,
        "--input",
        str(input_path),
        "--tokenizer",
        str(tokenizer),
        "--out",
        str(out),
        "--num-proc",
        str(num_proc),
    ]
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"method {name} failed:\n{result.stderr[-3000:]}")
    report = json.loads(result.stdout.strip().splitlines()[-1])
    seconds = report.get("encode_seconds", wall)
    cpu = report.get("encode_cpu_seconds", report["cpu_seconds"])
    report.update(
        method=name,
        wall_seconds=round(wall, 1),
        tokens_per_second=report["tokens"] / seconds,
        tokens_per_cpu_second=report["tokens"] / cpu,
    )
    return report


def main() -> None:
    parser = ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--mb", type=float, default=200.0, help="size of the generated JSONL input")
    parser.add_argument(
        "--scale", type=float, default=0, help="also run data.py on --mb * SCALE and compare peak RSS (0: skip)"
    )
    parser.add_argument("--vocab-size", type=int, default=33_069)
    parser.add_argument("--num-proc", type=int, default=os.cpu_count() or 1, help="datasets map workers")
    parser.add_argument("--methods", default="bare,data.py,data.py-pool,datasets")
    parser.add_argument(
        "--repeat", type=int, default=1, help="run the methods round-robin this many times and keep each one's best"
    )
    parser.add_argument("--workdir", default=None, help="keep files here (default: a temporary folder)")
    parser.add_argument("--method", help=argparse.SUPPRESS)
    parser.add_argument("--input", help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.method:  # a child process: run one method, print its JSON report
        report = METHODS[args.method](args)
        own, worker = peak_rss_mb()
        report.update(peak_rss_mb=round(own, 1), worker_rss_mb=round(worker, 1), cpu_seconds=cpu_seconds())
        print(json.dumps(report))
        return

    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_data_"))
    work.mkdir(parents=True, exist_ok=True)
    input_path = work / f"input-{args.mb:g}mb.jsonl"
    if not input_path.exists():
        started = time.perf_counter()
        count = generate_corpus(input_path, args.mb)
        print(
            f"generated {input_path} ({input_path.stat().st_size / 1e6:.0f} MB, {count} documents) "
            f"in {time.perf_counter() - started:.0f} s"
        )
    tokenizer = work / "tokenizer"
    if not tokenizer.exists():
        started = time.perf_counter()
        _, reached = data.train_tokenizer(read_texts_limited(input_path, 20_000_000), args.vocab_size, tokenizer)
        print(f"trained the tokenizer (vocab {reached}, on 20 MB) in {time.perf_counter() - started:.0f} s")

    reports = {}
    for _ in range(args.repeat):
        for name in args.methods.split(","):
            out = work / f"out-{name}"
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            report = run_method(name, input_path, tokenizer, out, args.num_proc)
            print(json.dumps(report), flush=True)
            if name not in reports or report["tokens_per_second"] > reports[name]["tokens_per_second"]:
                reports[name] = report
            shutil.rmtree(out, ignore_errors=True)

    print(f"\ninput {input_path.stat().st_size / 1e6:.0f} MB, {os.cpu_count()} CPUs")
    base = reports.get("bare")
    for name, report in reports.items():
        ratio = f"{report['tokens_per_second'] / base['tokens_per_second']:.2f}x bare" if base else ""
        cpu_ratio = f"{report['tokens_per_cpu_second'] / base['tokens_per_cpu_second']:.2f}x" if base else ""
        extra = (f", datasets cache {report['cache_mb']:.0f} MB" if "cache_mb" in report else "") + (
            f", corpus folder {report['disk_mb']:.0f} MB" if "disk_mb" in report else ""
        )
        workers = f" + workers {report['worker_rss_mb']:.0f} MB each" if report["worker_rss_mb"] else ""
        print(
            f"{name:12s} {report['tokens_per_second']:>10,.0f} tokens/s  {ratio:>10s}  "
            f"{report['tokens_per_cpu_second']:>10,.0f} tokens/CPU-s  {cpu_ratio:>6s}  "
            f"peak RSS {report['peak_rss_mb']:>6.0f} MB{workers}  wall {report['wall_seconds']:.0f} s{extra}"
        )
    for name in ("data.py", "data.py-pool"):
        if name in reports and "datasets" in reports:
            wall = reports[name]["tokens_per_second"] / reports["datasets"]["tokens_per_second"]
            cpu = reports[name]["tokens_per_cpu_second"] / reports["datasets"]["tokens_per_cpu_second"]
            print(f"{name} / datasets pipeline: {wall:.2f}x tokens/s, {cpu:.2f}x tokens per CPU-second")

    if args.scale:
        big = work / f"input-{args.mb * args.scale:g}mb.jsonl"
        if not big.exists():
            generate_corpus(big, args.mb * args.scale, seed=1)
        out = work / "out-scaled"
        out.mkdir(exist_ok=True)
        scaled = run_method("data.py", big, tokenizer, out, args.num_proc)
        shutil.rmtree(out, ignore_errors=True)
        small_rss = reports.get("data.py", {}).get("peak_rss_mb")
        print(
            f"data.py on {big.stat().st_size / 1e6:.0f} MB ({args.scale:g}x): peak RSS "
            f"{scaled['peak_rss_mb']:.0f} MB vs {small_rss} MB, {scaled['tokens_per_second']:,.0f} tokens/s"
        )
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)


def read_texts_limited(path: Path, max_bytes: int):
    total = 0
    for text in read_texts(str(path)):
        yield text
        total += len(text)
        if total >= max_bytes:
            return


if __name__ == "__main__":
    main()
