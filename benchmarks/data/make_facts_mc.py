"""Writes ``facts_mc.jsonl``: several hundred four-way multiple-choice questions of plain facts (capitals,
continents, colours, animals, arithmetic, opposites, units, the calendar) for ``bench_lm_eval.py --task-file``.

Written for this project (the facts are common knowledge, typed here; nothing downloaded). Deterministic: the
distractors and the answer's position come from a seeded generator, so rerunning the script rewrites the same file.
Each line is ``{"question", "choices", "label", "topic"}``; the question is a sentence prefix and each choice its
continuation after one space (the task's ``target_delimiter``). See ``facts_mc.md`` beside it.

    python benchmarks/data/make_facts_mc.py            # rewrites benchmarks/data/facts_mc.jsonl
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SEED = 54
OUT = Path(__file__).resolve().parent / "facts_mc.jsonl"

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Portugal": "Lisbon",
    "the United Kingdom": "London", "Ireland": "Dublin", "Belgium": "Brussels", "the Netherlands": "Amsterdam",
    "Austria": "Vienna", "Poland": "Warsaw", "the Czech Republic": "Prague", "Hungary": "Budapest",
    "Greece": "Athens", "Sweden": "Stockholm", "Norway": "Oslo", "Denmark": "Copenhagen", "Finland": "Helsinki",
    "Iceland": "Reykjavik", "Russia": "Moscow", "Ukraine": "Kyiv", "Romania": "Bucharest", "Bulgaria": "Sofia",
    "Serbia": "Belgrade", "Croatia": "Zagreb", "Slovakia": "Bratislava", "Slovenia": "Ljubljana",
    "Estonia": "Tallinn", "Latvia": "Riga", "Lithuania": "Vilnius", "Turkey": "Ankara", "Egypt": "Cairo",
    "Kenya": "Nairobi", "Nigeria": "Abuja", "Ethiopia": "Addis Ababa", "Ghana": "Accra", "Morocco": "Rabat",
    "Algeria": "Algiers", "Tunisia": "Tunis", "Senegal": "Dakar", "Uganda": "Kampala", "Zimbabwe": "Harare",
    "Japan": "Tokyo", "China": "Beijing", "South Korea": "Seoul", "North Korea": "Pyongyang",
    "India": "New Delhi", "Pakistan": "Islamabad", "Bangladesh": "Dhaka", "Thailand": "Bangkok",
    "Vietnam": "Hanoi", "the Philippines": "Manila", "Malaysia": "Kuala Lumpur", "Iran": "Tehran",
    "Iraq": "Baghdad", "Saudi Arabia": "Riyadh", "Syria": "Damascus", "Lebanon": "Beirut", "Jordan": "Amman",
    "Afghanistan": "Kabul", "Nepal": "Kathmandu", "Mongolia": "Ulaanbaatar", "Kazakhstan": "Astana",
    "Australia": "Canberra", "New Zealand": "Wellington", "Canada": "Ottawa", "Mexico": "Mexico City",
    "Cuba": "Havana", "Jamaica": "Kingston", "Argentina": "Buenos Aires", "Brazil": "Brasilia",
    "Chile": "Santiago", "Peru": "Lima", "Colombia": "Bogota", "Venezuela": "Caracas", "Ecuador": "Quito",
    "Uruguay": "Montevideo",
}

CONTINENTS = {
    "Europe": ["France", "Germany", "Italy", "Spain", "Portugal", "Ireland", "Belgium", "Austria", "Poland",
               "Hungary", "Greece", "Sweden", "Norway", "Denmark", "Finland", "Switzerland", "Romania"],
    "Asia": ["Japan", "China", "South Korea", "India", "Pakistan", "Thailand", "Vietnam", "Malaysia", "Nepal",
             "Mongolia", "Iraq", "Bangladesh", "Cambodia"],
    "Africa": ["Kenya", "Nigeria", "Ethiopia", "Ghana", "Morocco", "Algeria", "Senegal", "Uganda", "Zimbabwe",
               "Tanzania", "South Africa", "Angola", "Mali"],
    "South America": ["Argentina", "Brazil", "Chile", "Peru", "Colombia", "Venezuela", "Ecuador", "Uruguay",
                      "Bolivia", "Paraguay"],
    "North America": ["Canada", "the United States", "Mexico"],
    "Oceania": ["Australia", "New Zealand", "Fiji"],
}

COLOURS = {
    "a ripe banana": "yellow", "fresh grass": "green", "the sky on a clear day": "blue", "fresh snow": "white",
    "coal": "black", "blood": "red", "a ripe tomato": "red", "a carrot": "orange", "milk": "white",
    "a lemon": "yellow", "a pumpkin": "orange", "chocolate": "brown", "a ripe cherry": "red",
    "a ripe strawberry": "red", "a lime": "green", "a polar bear's fur": "white", "a crow": "black",
    "a flamingo": "pink", "an elephant": "grey", "a cucumber": "green", "a fire engine": "red",
    "a canary": "yellow", "an aubergine": "purple", "lavender flowers": "purple", "a tree trunk": "brown",
    "table salt": "white", "a stop sign": "red", "pine needles": "green", "a raven": "black",
    "a newly hatched chick": "yellow", "a walnut shell": "brown", "a blueberry": "blue", "a coffee bean": "brown",
    "tar": "black", "a ruby": "red", "an emerald": "green", "a sapphire": "blue", "a summer leaf": "green",
    "an orange": "orange", "a pig's skin": "pink", "storm clouds": "grey", "ripe wheat": "yellow",
    "a plum": "purple", "soot": "black", "cotton wool": "white",
}
COLOUR_NAMES = ["red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white", "grey"]

YOUNG = {
    "cat": "kitten", "dog": "puppy", "cow": "calf", "horse": "foal", "sheep": "lamb", "pig": "piglet",
    "frog": "tadpole", "duck": "duckling", "bear": "cub", "kangaroo": "joey", "swan": "cygnet", "goose": "gosling",
    "deer": "fawn", "hen": "chick", "owl": "owlet", "butterfly": "caterpillar", "goat": "kid", "lion": "cub",
}
SOUNDS = {
    "dog": "barks", "cat": "meows", "cow": "moos", "lion": "roars", "snake": "hisses", "horse": "neighs",
    "sheep": "bleats", "duck": "quacks", "pig": "oinks", "owl": "hoots", "bee": "buzzes", "frog": "croaks",
    "wolf": "howls", "donkey": "brays", "mouse": "squeaks", "rooster": "crows", "turkey": "gobbles",
}
LEGS = {"A spider": "eight", "An ant": "six", "A bee": "six", "A beetle": "six", "A dog": "four", "A cat": "four",
        "A horse": "four", "A cow": "four", "A chicken": "two", "A duck": "two", "A person": "two",
        "A snake": "no", "A fish": "no", "An ostrich": "two", "A lizard": "four", "A goat": "four"}
LEG_COUNTS = ["no", "two", "four", "six", "eight", "ten"]
HOMES = {"bee": "hive", "bird": "nest", "rabbit": "burrow", "horse": "stable", "pig": "sty", "bear": "den",
         "dog": "kennel", "beaver": "lodge", "spider": "web", "hermit crab": "shell"}
CLASSES = {
    "whale": "mammal", "dolphin": "mammal", "bat": "mammal", "dog": "mammal", "horse": "mammal", "mouse": "mammal",
    "eagle": "bird", "penguin": "bird", "ostrich": "bird", "owl": "bird", "parrot": "bird", "shark": "fish",
    "salmon": "fish", "tuna": "fish", "trout": "fish", "snake": "reptile", "crocodile": "reptile",
    "lizard": "reptile", "tortoise": "reptile", "frog": "amphibian", "salamander": "amphibian", "toad": "amphibian",
    "ant": "insect", "bee": "insect", "butterfly": "insect", "beetle": "insect", "grasshopper": "insect",
}
CLASS_NAMES = ["mammal", "bird", "fish", "reptile", "amphibian", "insect"]

OPPOSITES = [
    ("hot", "cold"), ("tall", "short"), ("up", "down"), ("fast", "slow"), ("happy", "sad"), ("day", "night"),
    ("open", "closed"), ("wet", "dry"), ("hard", "soft"), ("full", "empty"), ("early", "late"),
    ("heavy", "light"), ("rich", "poor"), ("strong", "weak"), ("loud", "quiet"), ("thick", "thin"),
    ("win", "lose"), ("push", "pull"), ("in", "out"), ("left", "right"), ("top", "bottom"), ("first", "last"),
    ("inside", "outside"), ("above", "below"), ("black", "white"), ("north", "south"), ("east", "west"),
    ("buy", "sell"), ("give", "take"), ("remember", "forget"), ("love", "hate"), ("friend", "enemy"),
    ("true", "false"), ("clean", "dirty"), ("cheap", "expensive"), ("high", "low"), ("near", "far"),
    ("asleep", "awake"), ("arrive", "leave"), ("increase", "decrease"), ("always", "never"), ("before", "after"),
    ("smooth", "rough"), ("entrance", "exit"), ("laugh", "cry"), ("ancient", "modern"), ("victory", "defeat"),
    ("wide", "narrow"), ("deep", "shallow"), ("dangerous", "safe"), ("cold", "hot"), ("big", "small"),
    ("empty", "full"), ("dark", "light"), ("question", "answer"), ("sweet", "sour"), ("war", "peace"),
    ("young", "old"), ("start", "finish"), ("good", "bad"),
]
#: distractors left out of one word's question: near-synonyms of its opposite
NOT_DISTRACTORS = {"win": {"defeat"}, "victory": {"lose"}, "big": {"short", "thin", "narrow", "low"},
                   "tall": {"small", "low"}, "high": {"short", "small"}, "wide": {"thin", "small"},
                   "thick": {"narrow", "small"}, "start": {"exit", "last", "after"}, "first": {"finish", "after"},
                   "entrance": {"out", "leave"}, "arrive": {"exit", "out"}, "in": {"exit"}, "inside": {"out", "exit"},
                   "young": {"ancient"}, "modern": {"old"}, "begin": {"finish"}, "top": {"below", "low", "down"},
                   "above": {"bottom", "down", "low"}, "up": {"below", "bottom", "low"}, "heavy": {"thin"},
                   "hard": {"light"}, "day": {"dark"}, "light": {"night"}, "dark": {"day"}, "early": {"after"},
                   "before": {"late"}}

UNITS = [
    ("seconds in a minute", 60), ("minutes in an hour", 60), ("hours in a day", 24), ("days in a week", 7),
    ("months in a year", 12), ("days in a year", 365), ("days in a leap year", 366), ("weeks in a year", 52),
    ("years in a decade", 10), ("years in a century", 100), ("years in a millennium", 1000),
    ("centimetres in a metre", 100), ("millimetres in a centimetre", 10), ("metres in a kilometre", 1000),
    ("grams in a kilogram", 1000), ("millilitres in a litre", 1000), ("inches in a foot", 12),
    ("feet in a yard", 3), ("ounces in a pound", 16), ("cents in a dollar", 100), ("eggs in a dozen", 12),
    ("sides of a triangle", 3), ("sides of a square", 4), ("sides of a pentagon", 5), ("sides of a hexagon", 6),
    ("sides of an octagon", 8), ("degrees in a right angle", 90), ("degrees in a full circle", 360),
    ("hours in two days", 48), ("minutes in half an hour", 30), ("days in the month of April", 30),
    ("days in the month of January", 31), ("players on a football (soccer) team on the field", 11),
    ("legs on a tripod", 3), ("wheels on a bicycle", 2), ("wheels on a tricycle", 3),
]
UNIT_NUMBERS = [2, 3, 4, 5, 6, 7, 8, 10, 11, 12, 16, 20, 24, 30, 31, 48, 50, 52, 60, 90, 100, 180, 360, 365, 366,
                1000]
MEASURES = {"Length": "metres", "Mass": "kilograms", "Time": "seconds", "Electric current": "amperes",
            "Power": "watts", "Temperature": "degrees", "Volume": "litres", "Electric charge": "coulombs"}

DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]


def question(rng: random.Random, topic: str, text: str, answer: str, pool) -> dict:
    """One item: ``answer`` and three distinct distractors from ``pool`` (never the answer), shuffled."""
    others = sorted({str(p) for p in pool} - {answer})
    choices = rng.sample(others, 3) + [answer]
    rng.shuffle(choices)
    return {"question": text, "choices": choices, "label": choices.index(answer), "topic": topic}


def knowledge(rng: random.Random) -> list[dict]:
    items = [question(rng, "capital", f"The capital of {c} is", a, CAPITALS.values()) for c, a in CAPITALS.items()]
    for continent, countries in CONTINENTS.items():
        items += [question(rng, "continent", f"{c[0].upper() + c[1:]} is a country in the continent of", continent,
                           CONTINENTS) for c in countries]
    items += [question(rng, "colour", f"The colour of {thing} is", c, COLOUR_NAMES) for thing, c in COLOURS.items()]
    items += [question(rng, "animal", f"A young {a} is called a", y, YOUNG.values()) for a, y in YOUNG.items()]
    items += [question(rng, "animal", f"When it makes a sound, a {a}", s, SOUNDS.values()) for a, s in SOUNDS.items()]
    legs = [f"{c} legs" for c in LEG_COUNTS]
    items += [question(rng, "animal", f"{a} has", f"{n} legs", legs) for a, n in LEGS.items()]
    items += [question(rng, "animal", f"A {a} lives in a", h, HOMES.values()) for a, h in HOMES.items()]
    items += [question(rng, "animal", f"A {a} is a kind of", k, CLASS_NAMES) for a, k in CLASSES.items()]
    return items


def reasoning(rng: random.Random) -> list[dict]:
    items = []
    for word, opposite in OPPOSITES:
        pool = {b for _, b in OPPOSITES} - {word} - {b for a, b in OPPOSITES if a == word}
        pool -= NOT_DISTRACTORS.get(word, set())
        items.append(question(rng, "opposite", f"The opposite of {word} is", opposite, pool | {opposite}))
    items += [question(rng, "unit", f"The number of {what} is", str(n), UNIT_NUMBERS) for what, n in UNITS]
    items += [question(rng, "unit", f"{q} is measured in", u, MEASURES.values()) for q, u in MEASURES.items()]
    for i, day in enumerate(DAYS):
        items.append(question(rng, "calendar", f"The day after {day} is", DAYS[(i + 1) % 7], DAYS))
        items.append(question(rng, "calendar", f"The day before {day} is", DAYS[i - 1], DAYS))
    for i, month in enumerate(MONTHS):
        items.append(question(rng, "calendar", f"The month after {month} is", MONTHS[(i + 1) % 12], MONTHS))
        items.append(question(rng, "calendar", f"The month before {month} is", MONTHS[i - 1], MONTHS))
    return items + arithmetic(rng)


def arithmetic(rng: random.Random) -> list[dict]:
    """Sums, differences and products of small numbers; distractors within a few of the answer."""
    items, seen = [], set()
    for op, count in (("+", 35), ("-", 25), ("x", 35)):
        while sum(1 for i in items if f" {'*' if op == 'x' else op} " in i["question"]) < count:
            a, b = rng.randint(2, 20 if op != "x" else 9), rng.randint(2, 20 if op != "x" else 9)
            if op == "-" and b > a:
                a, b = b, a
            if (a, op, b) in seen:
                continue
            seen.add((a, op, b))
            value = a + b if op == "+" else a - b if op == "-" else a * b
            near = [value + d for d in (-10, -3, -2, -1, 1, 2, 3, 10) if value + d >= 0]
            items.append(question(rng, "arithmetic", f"{a} {'*' if op == 'x' else op} {b} =", str(value), near))
    return items


def main() -> None:
    rng = random.Random(SEED)
    items = knowledge(rng) + reasoning(rng)
    with OUT.open("w") as f:
        for item in items:
            f.write(json.dumps(item) + "\n")
    topics = {}
    for item in items:
        topics[item["topic"]] = topics.get(item["topic"], 0) + 1
    print(f"{OUT.name}: {len(items)} questions", topics)


if __name__ == "__main__":
    main()
