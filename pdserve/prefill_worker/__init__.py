"""The prefill role: prompts in, first tokens back, KV out to decode workers."""
