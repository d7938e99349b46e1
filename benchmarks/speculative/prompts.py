"""The requests of ``loramux bench speculative``: a copy-heavy workload and a chat one.

**copy**: each request gives a passage of plain prose (about 200 words, 250 tokens with the
template; written for this benchmark) and asks for an answer that copies long spans of it:
rewrite it with one small edit, repeat it (the passage first, then the instruction: asked
the other way round, SmolLM2 summarises this one), copy out the sentences about one
subject, or write it out with its spelling mistakes corrected. Prompt lookup proposes the
passage's next tokens, and the answer mostly is them (SmolLM2-135M copies loosely: it
rephrases a clause here and there, and each rephrasing costs a rejected proposal).

**chat**: open everyday questions with no passage: the answer is new text, and prompt
lookup finds little to copy (only where the answer repeats itself).

Each in the model's chat template (the bare text for a tokenizer without one).
"""

from __future__ import annotations

LIGHTHOUSE = (
    "The lighthouse on the northern cape was built in 1871 from granite quarried on the "
    "island itself. For most of its working life it was kept by a single family, the "
    "Harlows, who lived in the small stone cottage at its base. Every evening the keeper "
    "climbed the one hundred and twelve steps to light the lamp, and every morning he "
    "climbed them again to trim the wick and polish the great glass lens. In the winter of "
    "1903 a storm broke the lantern windows, and the keeper's daughter, Ellen Harlow, kept "
    "the light burning through the night with a lamp held in her own hands. The lamp was "
    "converted to electricity in 1952, and the last keeper left in 1978, when the light "
    "became automatic. Today the cottage is a small museum, and visitors can climb the "
    "tower on summer afternoons to look out over the bay."
)

MARKET = (
    "Every Saturday morning the square in front of the old town hall fills with stalls. The "
    "baker from the hill village arrives first, before it is light, with trays of rye bread "
    "and small sweet buns that are usually gone by nine o'clock. Next to him a farmer sells "
    "eggs, honey and whatever vegetables the season gives: leeks and cabbages in winter, "
    "beans and tomatoes in late summer. At the far end of the square a woman mends clocks "
    "and watches at a folding table, and she will tell anyone who asks why a clock loses "
    "time in cold weather. Children gather around the cheese stall, where the owner cuts "
    "thin slices for them to taste. By one o'clock the stalls are packed away, the square is "
    "swept, and the pigeons return to the fountain as if nothing had happened."
)

CANAL = (
    "The canal was dug between 1794 and 1799 to carry coal from the valley mines to the "
    "river port. It runs for eleven miles and climbs through fourteen locks. The stone "
    "bridge at Millford was the first structure completed on the route, and its single arch "
    "is still the widest on the canal. Horses pulled the boats along the towpath, and a good "
    "horse could pull a load of thirty tons. In 1846 the bridge at Millford was widened so "
    "that two carts could pass each other on it. The railway arrived in 1860, and within "
    "twenty years most of the coal went by train instead. The canal closed to traffic in "
    "1931 and was slowly filled with reeds. Volunteers began clearing it in 1974, and the "
    "bridge at Millford was repaired with stone from the original quarry. Boats returned "
    "to the whole length of the canal in 2001."
)

GARDEN = (
    "The comunity garden on Elm Street started in 2015 on an empty lot that had been used "
    "for parking. Twelve neighbours met in the library to plan it, and the city agreed to "
    "lend the land for a small yearly fee. The first season was dificult: the soil was "
    "full of gravel, and most of the seeds were eaten by birds. In the second year the "
    "gardeners built raised beds from old timber and filled them with compost from the "
    "market. Now there are thirty beds, a tool shed and a rain barrel that colects water "
    "from the shed roof. Each family looks after one bed, and the beds along the fence "
    "grow vegetables for the food bank. On the first Sunday of every month everyone works "
    "together on the paths and the shared herbs, and afterwards they eat lunch at the long "
    "table under the pear tree."
)

COPY = (
    "Rewrite the following passage exactly as it is, changing only the family name Harlow "
    f"to Pembroke wherever it appears.\n\n{LIGHTHOUSE}",
    f"Here is a passage:\n\n{MARKET}\n\nRepeat the passage above exactly, word for word.",
    "From the following passage, copy out every sentence that mentions the bridge at "
    f"Millford, exactly as written, one per line.\n\n{CANAL}",
    "The following passage has three spelling mistakes. Write out the whole passage with "
    f"the mistakes corrected and nothing else changed.\n\n{GARDEN}",
)

CHAT = (
    "What are some good ways to stay focused while studying for exams?",
    "Explain how the gears on a bicycle make it easier to ride up a hill.",
    "Give me some ideas for a rainy weekend at home with two young children.",
    "Why do the leaves of many trees change colour in autumn?",
)

REQUESTS = {"copy": COPY, "chat": CHAT}
WORKLOADS = tuple(REQUESTS)


def prompts(tokenizer, workload: str) -> list[str]:
    """``REQUESTS[workload]``, each as the prompt the model gets."""
    if getattr(tokenizer, "chat_template", None) is None:
        return list(REQUESTS[workload])
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        for text in REQUESTS[workload]
    ]
