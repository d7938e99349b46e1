"""The quantized serve study."""
