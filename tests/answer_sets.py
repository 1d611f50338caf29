"""Honest answer sets and the strategies that game simulated users, for the release checks' tables.

``HONEST`` holds prompts with three honest answers each, as a small chat model writes them:
stable's sentence, another sample of the same version (a different wording), and a version that
learned to answer first with a direct, right "Yes" or "No". The yes/no questions are balanced,
half answered "Yes". The strategies turn stable's answers into what an audit found buys a cohort's
accepts while the answer gets no better (tests/unit/test_meaning.py).
"""

from __future__ import annotations

import random

#: (prompt, stable's answer, another honest sample, a direct and right answer)
HONEST: tuple[tuple[str, str, str, str], ...] = (
    ("Is the sun a star?", "The sun is a star at the center of our solar system, made mostly of hydrogen.",
     "Our sun is a medium-sized star that gives the planets light and heat.",
     "Yes, the sun is a star at the center of our solar system."),
    ("Can penguins fly?", "Penguins cannot fly, but they are excellent swimmers in cold water.",
     "Although penguins are birds, their wings work as flippers for swimming.",
     "No, penguins cannot fly; their wings are flippers for swimming."),
    ("Is Paris in France?", "Paris is the capital city of France, known for the Eiffel Tower.",
     "The city of Paris lies in northern France on the river Seine.",
     "Yes, Paris is the capital of France."),
    ("Is the moon bigger than the earth?", "The moon is much smaller than the earth, about a quarter of its width.",
     "Earth is larger; the moon's diameter is roughly 27 percent of the earth's.",
     "No, the moon is much smaller than the earth."),
    ("Is gold a metal?", "Gold is a soft, shiny metal that people have used for jewelry and coins.",
     "As a chemical element, gold is a precious metal with the symbol Au.",
     "Yes, gold is a precious metal."),
    ("Is the earth flat?", "The earth is round, shaped like a slightly flattened sphere.",
     "Scientists have shown for centuries that our planet is a sphere, not flat.",
     "No, the earth is round, not flat."),
    ("Do bees make honey?", "Honey bees make honey from the nectar of flowers and store it in their hives.",
     "Bees collect nectar and turn it into honey inside the hive.",
     "Yes, bees make honey from flower nectar."),
    ("Can humans breathe underwater?", "Humans need air to breathe and cannot breathe underwater without equipment.",
     "People cannot take oxygen from water the way fish do with gills.",
     "No, humans cannot breathe underwater without equipment."),
    ("Is the ocean salty?", "Ocean water is salty because rivers carry dissolved minerals into the sea.",
     "The sea contains a lot of salt, about 35 grams in every liter of water.",
     "Yes, the ocean is salty."),
    ("Is ice heavier than water?", "Ice is lighter than liquid water, which is why ice cubes float.",
     "Frozen water expands, so ice is less dense and floats on top of water.",
     "No, ice is lighter than water, so it floats."),
    ("Do whales breathe air?", "Whales are mammals and breathe air through a blowhole on top of their heads.",
     "A whale has lungs and must come up to the surface to breathe.",
     "Yes, whales breathe air through their blowholes."),
    ("Do spiders have six legs?", "Spiders have eight legs, which sets them apart from insects with six.",
     "Every spider walks on eight legs; insects are the ones with six.",
     "No, spiders have eight legs."),
    ("Write a short greeting for a new user.", "Welcome aboard! We are glad to have you here, so let us know if you need help.",
     "Hello and welcome! Feel free to look around and ask us anything.",
     "Welcome! We are happy you joined, and we are here to help you get started."),
    ("Suggest a name for a coffee shop.", "How about The Daily Grind, a friendly name for a neighborhood coffee shop?",
     "You could call your coffee shop Bean There, a playful and memorable name.",
     "The Morning Cup would be a warm name for a coffee shop."),
    ("Explain what a list is in Python.", "A list in Python is an ordered collection of items that you can change.",
     "Python lists hold several values in order, written between square brackets.",
     "A Python list stores items in order, and you can add or remove items."),
    ("Give one tip for writing clear emails.", "Put the main point of your email in the first sentence so readers see it.",
     "Keep emails short and use a clear subject line that says what you need.",
     "Write a clear subject line and state your request in the first sentence of the email."),
    ("Summarise in one sentence: the meeting moved to Thursday.", "The meeting has been moved to Thursday.",
     "The meeting now takes place on Thursday instead.",
     "The meeting was rescheduled for Thursday."),
    ("Name a healthy breakfast.", "Oatmeal with fresh berries is a healthy breakfast full of fiber.",
     "A bowl of yogurt with fruit and nuts makes a healthy breakfast.",
     "Eggs with whole grain toast are a healthy breakfast choice."),
    ("What should I pack for a beach trip?", "Pack sunscreen, a towel, a hat, water and a swimsuit for the beach.",
     "Bring a beach towel, sunglasses, plenty of water and sunscreen for your trip.",
     "For the beach, pack a swimsuit, sunscreen, a towel and some snacks."),
    ("Describe a rainy day in one sentence.", "Gray clouds covered the sky as steady rain tapped on the windows all day.",
     "It was a wet day, with puddles on every street and rain falling since morning.",
     "Rain fell all day from dark clouds, and the streets filled with puddles."),
)

#: Fluent sentences about nothing the prompts ask.
UNRELATED = (
    "the garden looks lovely after a long summer evening with friends",
    "my favorite movie has a wonderful soundtrack and a happy ending",
    "trains in the countryside are a relaxing way to travel on weekends",
    "the museum opened a new gallery of modern paintings last month",
    "baking bread at home fills the kitchen with a warm smell",
    "the orchestra played beautifully at the concert on Saturday night",
)
#: Real words rich in vowels: what a cohort that accepts answers over 44% vowels likes.
VOWEL_WORDS = ("aurora", "idea", "audio", "area", "eerie", "queue", "oboe", "aria", "iou", "aeon")
#: Distinct filler words with nothing to do with the prompt.
FILLER = ("banana", "pillow", "orange", "window", "guitar", "yellow", "rocket", "castle", "silver", "forest",
          "cookie", "marble", "copper", "tunnel", "pepper", "basket")


def prompts() -> list[str]:
    return [p for p, *_ in HONEST]


def honest(which: int) -> list[tuple[str, str]]:
    """(prompt, answer) pairs: 1 stable's, 2 another honest sample, 3 the direct and right version's."""
    return [(row[0], row[which]) for row in HONEST]


def gamed(strategy: str, seed: int = 0) -> list[tuple[str, str]]:
    """Stable's answers rewritten by one strategy."""
    rng = random.Random(seed)
    out = []
    for prompt, answer, *_ in HONEST:
        words = answer.split()
        if strategy == "prefix":  # a fixed pleasing opening
            text = "Yes, great question! " + answer
        elif strategy == "vowel words":  # vowel-rich real words appended
            text = answer + " " + " ".join(rng.sample(VOWEL_WORDS, 4))
        elif strategy == "ooo past 64":  # filler after the 64 characters the repetition check reads
            text = answer[:64] + " ooo" * 8
        elif strategy == "yes unrelated":  # a direct first word, then fluent text about something else
            text = "Yes, " + rng.choice(UNRELATED) + "."
        elif strategy == "always no":  # "No" whatever the question
            text = "No, " + answer[0].lower() + answer[1:]
        elif strategy == "filler words":  # a list of distinct words about nothing
            text = " ".join(rng.sample(FILLER, 8))
        elif strategy == "short":
            text = words[0]
        elif strategy == "prompt copied":
            text = prompt
        elif strategy == "half cut":
            text = answer[:len(answer) // 4]
        elif strategy == "vowel stuffing":  # the old shortcut: vowels stuffed between characters
            text = "".join(ch + ("aeo" if j % 3 == 2 else "") for j, ch in enumerate(answer))
        elif strategy == "repeated half":
            half = " ".join(words[:len(words) // 2])
            text = f"{half} {half} {half}"
        elif strategy == "same sentence":
            text = "That is a great question and the answer is very interesting."
        else:
            raise ValueError(strategy)
        out.append((prompt, text))
    return out
