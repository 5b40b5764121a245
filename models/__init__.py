"""Model definitions and adapters (HF Llama patching, presets)."""
