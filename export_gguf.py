"""GGUF for llama.cpp and ollama: `python export_gguf.py RUN/model --out model.gguf --type q8_0` (docs/gguf.md).
The code: tinyllm/outputs/export_gguf.py."""

from tinyllm.outputs.export_gguf import command

if __name__ == "__main__":
    command()
