"""The engine vs peft study."""
