"""The quant quality study."""
