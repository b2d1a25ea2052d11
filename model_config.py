"""The model presets (`train.py --preset NAME`) with their shapes and parameter counts:
`python model_config.py [--vocab-size N]`. The code: tinyllm/model/config.py."""

from tinyllm.model.config import command

if __name__ == "__main__":
    command()
