"""The model: the Qwen3 presets, attention and its kernels, the per-card rules, the loss, generating."""
