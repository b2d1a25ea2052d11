"""A run's outputs: `python report.py plot|samples|evaluate|publish RUN ...` (docs/evaluation.md).
The code: tinyllm/outputs/report.py."""

from tinyllm.outputs.report import command

if __name__ == "__main__":
    command()
