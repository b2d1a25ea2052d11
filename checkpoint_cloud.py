"""A run's backup: `python checkpoint_cloud.py list|push|pull|verify ...` (docs/backups.md).
The code: tinyllm/store/checkpoint_cloud.py."""

from tinyllm.store.checkpoint_cloud import command

if __name__ == "__main__":
    command()
