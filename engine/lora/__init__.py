"""LoRA adapters: loading PEFT files, residency in the weight pool, per-step metadata."""
