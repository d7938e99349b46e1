"""``loramux bench llama-cpp``: the embedded default against llama.cpp on the same GGUF."""
