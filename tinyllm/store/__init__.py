"""Where a run is kept: remote storage, checkpoints and run_status.json, the backup (checkpoint_cloud.py)."""
