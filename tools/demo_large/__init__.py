"""The larger demo target (issue #15): corpus from permissively licensed installed packages, a
64M-parameter Qwen3 shape, and a resumable GPU/CPU training loop with sharded bf16 export."""
