"""Speed of export_gguf.py on a think72-sized model against just reading and writing its bytes.

    python bench/bench_gguf.py                 # think72 in f16, target: ratio < 2
    python bench/bench_gguf.py --type q8_0 --repeats 1
    python bench/bench_gguf.py --preset small125

Builds a random-weight folder of the preset (saved as train.py saves it: f32 safetensors) with
a byte-level BPE trained on generated text to (nearly) 33,069 tokens, then times, alternately:
- baseline: read every byte of model.safetensors, write as many bytes as the GGUF has, fsync;
- export: export_gguf.export(folder, out, TYPE) in this process (imports already done);
and prints best-of-N wall and CPU seconds and their ratios (CPU time, summed over threads, is
the steadier figure on a busy machine). The whole CLI (a fresh interpreter) is timed once too.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tinyllm.common import ArgumentParser  # noqa: E402
from tinyllm.data import build as data  # noqa: E402
from tinyllm.model import config as model_config  # noqa: E402
from tinyllm.outputs import export_gguf  # noqa: E402

CHUNK = 8 * 1024 * 1024


def generated_texts(words: int, seed: int = 0) -> list[str]:
    """Text over a large invented lexicon (Zipf-like frequencies), so BPE can reach a 33k vocabulary."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    lexicon = ["".join(rng.choice(letters) for _ in range(rng.randint(3, 11))) for _ in range(60_000)]
    weights = [1.0 / (rank + 10) for rank in range(len(lexicon))]
    stream = rng.choices(lexicon, weights=weights, k=words)
    return [" ".join(stream[start : start + 200]) for start in range(0, len(stream), 200)]


def build_folder(folder: Path, preset: str, vocab_size: int, words: int) -> int:
    """A random model of `preset` with a tokenizer as close to `vocab_size` as the text allows."""
    import torch

    tokenizer, _ = data.train_tokenizer(generated_texts(words), vocab_size, folder)
    torch.manual_seed(0)
    model = model_config.build_model(model_config.PRESETS[preset], len(tokenizer))
    model.save_pretrained(folder)
    return len(tokenizer)


def read_and_write(source: Path, target: Path, out_bytes: int) -> None:
    """Read every byte of `source` and write `out_bytes` bytes to `target` (fsynced)."""
    with open(source, "rb") as handle:
        while handle.read(CHUNK):
            pass
    block = b"\0" * CHUNK
    with open(target, "wb") as handle:
        left = out_bytes
        while left > 0:
            left -= handle.write(block[: min(CHUNK, left)])
        handle.flush()
        os.fsync(handle.fileno())


def timed(run) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process: all threads, user + system) of run()."""
    wall, cpu = time.perf_counter(), time.process_time()
    run()
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--work", type=Path, default=ROOT / "bench" / "out" / "gguf", help="scratch folder")
    parser.add_argument("--preset", default="think72", choices=list(model_config.PRESETS))
    parser.add_argument("--type", default="f16", choices=list(export_gguf.OUT_TYPES))
    parser.add_argument("--vocab-size", type=int, default=data.DEFAULT_VOCAB_SIZE)
    parser.add_argument("--words", type=int, default=1_500_000, help="words of generated tokenizer text")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    folder = args.work / f"{args.preset}-model"
    if not (folder / "model.safetensors").is_file():
        started = time.perf_counter()
        vocab = build_folder(folder, args.preset, args.vocab_size, args.words)
        print(f"built {folder} (vocab {vocab}) in {time.perf_counter() - started:.0f}s")
    source = export_gguf.read_model_folder(folder)
    params = model_config.parameter_count(model_config.PRESETS[args.preset], source.vocab_size)
    weights = folder / "model.safetensors"
    out = args.work / f"{args.preset}-{args.type}.gguf"
    print(
        f"model: {args.preset} shape, {params:,} parameters, vocab {source.vocab_size} "
        f"(requested {args.vocab_size}), {weights.stat().st_size / 1e6:.0f} MB of f32 safetensors"
    )

    export_gguf.export(folder, out, args.type, overwrite=True)  # warm-up: page cache, lazy imports
    out_bytes = out.stat().st_size
    baseline, exported = [], []
    for _ in range(args.repeats):
        baseline.append(timed(lambda: read_and_write(weights, args.work / "copy.bin", out_bytes)))
        exported.append(timed(lambda: export_gguf.export(folder, out, args.type, overwrite=True)))
    (args.work / "copy.bin").unlink()

    started = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "export_gguf.py"),
            str(folder),
            "--out",
            str(out),
            "--type",
            args.type,
            "--overwrite",
        ],
        check=True,
        capture_output=True,
    )
    cli = time.perf_counter() - started

    def show(label: str, runs: list[tuple[float, float]]) -> None:
        print(
            f"{label}: best {min(wall for wall, _ in runs):.2f}s wall, {min(cpu for _, cpu in runs):.2f}s CPU "
            f"(runs {', '.join(f'{wall:.2f}/{cpu:.2f}' for wall, cpu in runs)})"
        )

    show(f"baseline read {weights.stat().st_size / 1e6:.0f} MB + write {out_bytes / 1e6:.0f} MB", baseline)
    show(f"export {args.type}", exported)
    print(f"whole CLI in a fresh interpreter (imports included): {cli:.2f}s")
    wall_ratio = min(wall for wall, _ in exported) / min(wall for wall, _ in baseline)
    cpu_ratio = min(cpu for _, cpu in exported) / min(cpu for _, cpu in baseline)
    print(f"ratio export / baseline: {wall_ratio:.2f}x wall (target < 2x), {cpu_ratio:.2f}x CPU time")


if __name__ == "__main__":
    main()
