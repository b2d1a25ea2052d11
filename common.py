"""tinyllm's layout: `python common.py` lists the commands and where the code of each layer lives.
The code: tinyllm/common.py (the helpers every layer shares) and tinyllm/__init__.py (the layers)."""

from tinyllm.common import command

if __name__ == "__main__":
    command()
