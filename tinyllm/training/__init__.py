"""The run: its data, the optimization, the ranks, --budget, and train.py's loop, which composes every layer."""
