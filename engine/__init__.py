"""loramux engine: one shared base model, many LoRA adapters per batch."""
