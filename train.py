"""Train a model: `python train.py` (the CPU demo), `python train.py --data CORPUS --out RUN`,
`torchrun --nproc_per_node=2 train.py ...`, `python train.py --resume` (docs/training.md).
The code: tinyllm/training/train.py."""

from tinyllm.training.train import command

if __name__ == "__main__":
    command()
