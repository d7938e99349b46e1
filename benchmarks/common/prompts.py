"""Prompts for the benchmarks: short everyday questions in the model's chat template, and
random token ids.

Chat prompts: request i asks ``QUESTIONS[i % 32]``; from the 33rd on a question ends with
"(Answer #n.)" so that no two prompts are the same. A tokenizer without a chat template
gets the bare question. Both systems of a comparison get the same token ids.
"""

from __future__ import annotations

import threading

import numpy as np

QUESTIONS = (
    "What is the capital of France?",
    "Give me three tips for sleeping better.",
    "Explain photosynthesis to a ten-year-old.",
    "Write a haiku about autumn leaves.",
    "How do I boil an egg?",
    "What causes the seasons on Earth?",
    "Suggest a name for a grey cat.",
    "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet.",
    "What is a prime number?",
    "How can I learn to play the guitar?",
    "Translate 'good morning' into Spanish.",
    "What are the benefits of drinking water?",
    "Describe a rainy day in two sentences.",
    "How does a bicycle stay upright?",
    "Give me a simple recipe for pancakes.",
    "What is the difference between weather and climate?",
    "Write a short thank-you note to a teacher.",
    "How many legs does a spider have?",
    "What should I pack for a weekend hike?",
    "Explain what a computer program is.",
    "Why do leaves change colour in the fall?",
    "Tell me a fun fact about octopuses.",
    "How do I make my houseplants grow better?",
    "What is the tallest mountain in the world?",
    "Write a two-line poem about the sea.",
    "How do vaccines work?",
    "What is the Pythagorean theorem?",
    "Give me an idea for a birthday party.",
    "Why do we need sleep?",
    "What is the best way to save money?",
    "Describe the taste of a lemon.",
)


def chat_prompts(tokenizer, count: int) -> list[list[int]]:
    """``count`` prompts as token ids, in request order."""
    prompts = []
    for i in range(count):
        question = QUESTIONS[i % len(QUESTIONS)]
        if i >= len(QUESTIONS):
            question = f"{question} (Answer #{i // len(QUESTIONS) + 1}.)"
        messages = [{"role": "user", "content": question}]
        try:
            text = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
        except ValueError:  # a tokenizer without a chat template
            text = question
        prompts.append(list(tokenizer(text, add_special_tokens=False)["input_ids"]))
    return prompts


class Prompts:
    """Random prompt token ids (EOS avoided), a fresh prompt per call (no prefix-cache hits)."""

    def __init__(self, vocab_size: int, avoid, seed: int = 0):
        avoid = set(avoid)
        self._ids = np.array([i for i in range(3, vocab_size) if i not in avoid])
        self._rng = np.random.default_rng(seed)
        self._lock = threading.Lock()

    def __call__(self, length: int) -> list[int]:
        with self._lock:
            return self._rng.choice(self._ids, size=length).tolist()
