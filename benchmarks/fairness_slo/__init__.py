"""The fairness slo study."""
