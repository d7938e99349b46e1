"""The adapter churn study."""
