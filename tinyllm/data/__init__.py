"""The corpus: its format, the demo corpus and the builder (data.py)."""
