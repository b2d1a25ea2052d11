"""tinyllm: pretrain small Qwen3 language models from scratch.

The layers, each importing only the ones above it in this list (tests/test_imports.py checks it):

    common.py    errors, atomic writes, hashing, the option declarations and --config, `say`
    data/        the corpus: its format (corpus_format), the demo corpus (demo_corpus), the builder (build: data.py)
    model/       the Qwen3 model (config), attention and its kernels (attention, varlen_ops), the per-card rules
                 (hardware), the loss (losses), generating (generation)
    store/       remote storage (remote_store), checkpoints and run_status.json (checkpoint_store), the backup
                 (checkpoint_cloud: checkpoint_cloud.py)
    outputs/     what a run records and makes: metrics.jsonl (metrics_log) and its trackers, the run's observers
                 (callbacks), the end-of-run artifacts, evaluation, the exports (export_hf, export_gguf:
                 export_gguf.py), publishing, the report (report: report.py)
    training/    the run: its data (train_data), the optimization (optimization, muon), the ranks (distributed),
                 --budget (budget), and train (train.py), which composes every layer

The scripts at a clone's root (train.py, data.py, report.py, ...) are a few lines each calling a module's
`command`; docs/development.md ("Where things live") maps every module. Nothing runs at import.
"""
