"""Training prompts that never come from the evaluation sets.

Acceptance is measured on `shared/data/prompts/` (GSM8K, HumanEval, MT-Bench); training on
them would measure memorisation. The drafter is trained on the target's own answers to
prompts built here, from three offline sources that need no download:

- math word problems generated from templates with random names, items and numbers (the
  style of grade-school math, none of its problems);
- code prompts from the Python standard library installed with the interpreter: write a
  function given its name, signature and the first line of its docstring, explain a short
  function's source, or (`code_stubs`) implement a signature + docstring;
- general instructions from templates over topic word lists (explain, compare, list, write;
  `text_extended` adds role play, extraction, puzzles, critique, plans, dialogues).

Everything is deterministic in the seed.
"""

from __future__ import annotations

import ast
import functools
import os
import random
import sysconfig
import textwrap
from collections.abc import Iterator

MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."

_NAMES = ["Maya", "Liam", "Aisha", "Tomas", "Priya", "Kenji", "Sofia", "Omar", "Elena", "Noah",
          "Zara", "Diego", "Hana", "Felix", "Amara", "Jonas", "Leila", "Ravi", "Ines", "Marco"]
_ITEMS = [("apples", "basket"), ("stickers", "sheet"), ("pencils", "box"), ("cookies", "tray"),
          ("marbles", "jar"), ("books", "shelf"), ("seeds", "packet"), ("eggs", "carton"),
          ("cards", "deck"), ("bottles", "crate")]
_MATH = [
    "{a} has {x} {item}. {b} gives {a} {y} more, and then {a} uses {z} of them. How many {item} does {a} have now?",
    "A {unit} holds {x} {item}. {a} buys {y} {unit}s and gives away {z} {item}. How many {item} are left?",
    "{a} earns ${x} per hour and works {y} hours a week. After spending ${z} each week, how much does {a} save in {w} weeks?",
    "{a} reads {x} pages on Monday and twice as many on Tuesday. If the book has {y} pages, how many pages are left after Tuesday?",
    "There are {x} students in a class. {p}% of them play soccer and {q} of the rest play chess. How many students play chess?",
    "{a} runs {x} kilometers every day for {y} days, then rests for {z} days and runs {w} kilometers a day for another {y} days. How far did {a} run in total?",
    "A shop sells {item} at ${x} each. {a} buys {y} and pays with ${big}. How much change does {a} get?",
    "{a} and {b} share {x} {item} so that {a} gets {y} more than {b}. How many {item} does {b} get?",
    "A train travels {x} km in {y} hours. At the same speed, how long does it take to travel {big} km?",
    "{a} saves ${x} in the first month and ${y} more each month than the month before. How much has {a} saved after {z} months?",
    "A rectangle has a perimeter of {big} cm and a width of {x} cm. What is its area?",
    "{a} bakes {x} trays of {item} with {y} on each tray. {a} sells {p}% of them. How many are not sold?",
]
_TOPICS = ["photosynthesis", "compound interest", "the water cycle", "binary search", "plate tectonics",
           "supply and demand", "vaccines", "black holes", "recursion", "the French Revolution",
           "machine learning", "climate change", "the immune system", "prime numbers", "electric cars",
           "the stock market", "sleep", "volcanoes", "democracy", "the internet", "gravity", "DNA",
           "renewable energy", "inflation", "the Roman Empire", "hash tables", "bees", "coffee",
           "the printing press", "coral reefs", "public transport", "sorting algorithms", "antibiotics",
           "the solar system", "budgeting", "earthquakes", "the Silk Road", "neural networks",
           "composting", "the Moon landing", "rainforests", "encryption", "the human heart",
           "time zones", "probability", "the Renaissance", "ocean tides", "recycling", "bread baking",
           "operating systems", "chess openings", "the Olympic Games", "memory and learning",
           "glaciers", "taxes", "spreadsheets", "bird migration", "unit testing", "music theory",
           "the Industrial Revolution", "nutrition", "version control", "lightning", "mushrooms",
           "photography", "databases", "first aid", "the metric system", "magnets", "urban gardening",
           "jazz", "the Great Wall of China", "solar panels", "dinosaurs", "public speaking", "rivers",
           "credit scores", "wind turbines", "honeybees and pollination", "the periodic table", "yoga",
           "the Cold War", "quantum computing", "deserts", "social media", "healthy breakfast habits",
           "cloud computing", "the Amazon river", "penguins", "the scientific method", "origami",
           "marathon training", "electric circuits", "ancient Egypt", "minimalism", "3D printing",
           "the human brain", "volunteering", "board games", "the speed of light", "chocolate",
           "remote work", "tsunamis", "the history of writing", "robots", "vitamins", "hiking safety",
           "cryptocurrency", "the ozone layer", "learning a new language", "forests", "smartphones",
           "the Olympic marathon", "friendship", "job interviews", "saving money", "owls", "rainbows"]
_PAIRS = [("cats", "dogs"), ("Python", "JavaScript"), ("tea", "coffee"), ("trains", "planes"),
          ("renting", "buying a home"), ("email", "phone calls"), ("solar power", "wind power"),
          ("books", "films"), ("cities", "the countryside"), ("TCP", "UDP"), ("lists", "tuples")]
_TASKS = [
    "Explain {topic} to a twelve-year-old.",
    "Write a short paragraph about {topic}.",
    "Give three interesting facts about {topic}.",
    "What are the main advantages and disadvantages of {a} compared with {b}?",
    "Write a short poem about {topic}.",
    "Summarize the key ideas of {topic} in five bullet points.",
    "Write a friendly email inviting a colleague to a talk about {topic}.",
    "What are common misconceptions about {topic}?",
    "Compare {a} and {b} in a short table, then give a recommendation.",
    "Write a short story in which a child learns about {topic}.",
    "List five questions a student might ask about {topic}, with brief answers.",
    "Give step-by-step advice for someone who wants to learn about {topic}.",
    "Write a blog post introduction about {topic}.",
    "Imagine you are a museum guide. Describe an exhibit about {topic}.",
    "Explain {topic} using an everyday analogy.",
    "Write a dialogue between a teacher and a student about {topic}.",
    "What would the world look like without {topic}? Answer in a short essay.",
    "Create a short quiz with three multiple-choice questions about {topic}.",
    "Describe the history of {topic} in a few paragraphs.",
    "Write a persuasive paragraph arguing that everyone should learn about {topic}.",
    "Give a one-week plan for a beginner to get started with {topic}.",
    "Write a haiku and then a limerick about {topic}.",
    "Which is better for a small town, {a} or {b}? Explain your reasoning.",
    "Write a product description for a book about {topic}.",
]


def math_prompts(rng: random.Random, n: int) -> Iterator[str]:
    for _ in range(n):
        a, b = rng.sample(_NAMES, 2)
        item, unit = rng.choice(_ITEMS)
        x, y = rng.randint(3, 60), rng.randint(2, 25)
        z = rng.randint(1, max(1, min(x, 20)))
        text = rng.choice(_MATH).format(
            a=a, b=b, item=item, unit=unit, x=x, y=y, z=z, w=rng.randint(2, 12),
            p=rng.choice([10, 20, 25, 40, 50, 75]), q=rng.randint(1, 9), big=rng.randint(100, 900),
        )
        yield text + MATH_SUFFIX


@functools.lru_cache(maxsize=4)
def _stdlib_functions(limit_files: int, seed: int, methods: bool = False) -> tuple[tuple[str, str, str], ...]:
    """(signature, docstring first line, source) of documented stdlib functions; with
    `methods`, also the public documented methods of top-level classes (`Class.name(...)`),
    about three times as many."""
    rng = random.Random(seed)
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("test", "tests", "idlelib", "site-packages", "lib2to3"))
        files += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
    rng.shuffle(files)
    found = []
    for path in files[:limit_files]:
        try:
            with open(path, encoding="utf-8") as fh:
                source = fh.read()
            tree = ast.parse(source)
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        defs = [("", node) for node in tree.body]
        if methods:
            defs += [(f"{c.name}.", node) for c in tree.body if isinstance(c, ast.ClassDef)
                     and not c.name.startswith("_") for node in c.body]
        for owner, node in defs:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                doc = ast.get_docstring(node)
                segment = ast.get_source_segment(source, node) or ""
                if doc and 3 <= len(segment.splitlines()) <= 30:
                    sig = f"{owner}{node.name}({ast.unparse(node.args)})"
                    if owner:  # the first line lost its indentation; restore it, then dedent all
                        segment = textwrap.dedent(" " * node.col_offset + segment)
                        try:
                            ast.parse(segment)
                        except SyntaxError:  # tabs or column-0 string bodies: skip
                            continue
                    found.append((sig, doc.strip().splitlines()[0], segment))
    return tuple(found)


def _stub(source: str) -> str:
    """`source` (one function's dedented text) cut after its docstring: the signature and
    the documentation, no body."""
    fn = ast.parse(source).body[0]
    return "\n".join(source.splitlines()[: fn.body[0].end_lineno])


def code_prompts(rng: random.Random, n: int, *, methods: bool = False, stubs: bool = False) -> Iterator[str]:
    """Write-this-function and explain-this-function prompts over documented stdlib
    functions; with `stubs`, a third kind gives the signature and whole docstring as code
    to implement (the shape of a HumanEval task, none of its problems)."""
    funcs = list(_stdlib_functions(400, rng.randrange(2**31), methods))
    rng.shuffle(funcs)
    kinds = 3 if stubs else 2
    # Each function first as one kind of prompt, then (once all are used) as the next kind.
    for i in range(min(n, kinds * len(funcs))):
        sig, doc, source = funcs[i % len(funcs)]
        # Two kinds keep the order of the runs that had only two (same prompts per seed).
        kind = (i % len(funcs) + i // len(funcs)) % 3 if stubs else (i + i // len(funcs)) % 2
        if kind == 0:
            yield f"Write a Python function `{sig}`. It should do the following: {doc}"
        elif kind == 1:
            yield f"Explain what this Python function does:\n```python\n{source}\n```"
        else:
            yield f"Implement this Python function; its docstring says what it must do:\n```python\n{_stub(source)}\n```"


_ROLES = ["tour guide", "science teacher", "chef", "detective", "librarian", "personal trainer", "museum curator",
          "ship captain", "gardener", "astronaut", "journalist", "village baker", "park ranger", "game designer"]
_CONSTRAINTS = ["in exactly three sentences", "in under 80 words", "as a numbered list", "without using the letter z",
                "in the style of a news report", "for a five-year-old", "with one analogy per paragraph",
                "as a short FAQ", "in a cheerful tone", "in a formal tone"]


def _extended_instruction(rng: random.Random) -> str:
    """One prompt of the extended instruction kinds: role play, extraction from a generated
    word problem, ordering puzzles, explanations under a constraint, critique, study plans,
    dialogues."""
    a, b, c = rng.sample(_NAMES, 3)
    topic = rng.choice(_TOPICS)
    kind = rng.randrange(7)
    if kind == 0:
        return (f"You are a {rng.choice(_ROLES)}. Someone asks you about {topic}. "
                f"Answer in character, {rng.choice(_CONSTRAINTS)}.")
    if kind == 1:
        problem = next(math_prompts(rng, 1))[: -len(MATH_SUFFIX)]
        return f"List every person, object and number mentioned in this text as JSON, without solving it:\n{problem}"
    if kind == 2:
        more, most, least = rng.choice([("older", "oldest", "youngest"), ("taller", "tallest", "shortest"),
                                        ("faster", "fastest", "slowest"), ("heavier", "heaviest", "lightest")])
        return (f"{a} is {more} than {b}, and {b} is {more} than {c}. Order the three from {most} to {least} "
                f"and explain your reasoning.")
    if kind == 3:
        return f"Explain {topic} {rng.choice(_CONSTRAINTS)}."
    if kind == 4:
        return (f"{a} claims that {topic} does not matter in everyday life. "
                f"Write a short, fair critique of that claim, then give {a} one practical example.")
    if kind == 5:
        days = rng.randint(2, 7)
        return f"Plan a {days}-day study schedule for {b}, who wants to understand {topic}. Keep each day to three tasks."
    x, y = rng.choice(_PAIRS)
    return f"Write a short dialogue in which {a} prefers {x} and {b} prefers {y}; end with a compromise."


def instruction_prompts(rng: random.Random, n: int, *, extended: bool = False) -> Iterator[str]:
    """Template instructions over topic lists; with `extended`, half of them from the
    extended kinds (`_extended_instruction`), which widen what the text source covers."""
    for _ in range(n):
        if extended and rng.random() < 0.5:
            yield _extended_instruction(rng)
            continue
        a, b = rng.choice(_PAIRS)
        yield rng.choice(_TASKS).format(topic=rng.choice(_TOPICS), a=a, b=b)


def training_prompts(n: int, *, seed: int = 0, mix: tuple[float, float, float] = (0.4, 0.35, 0.25),
                     code_methods: bool = False, code_stubs: bool = False,
                     text_extended: bool = False) -> list[str]:
    """`n` distinct prompts: math / code / instructions in proportion `mix`, shuffled.

    A source that runs out of distinct prompts (code: two per documented stdlib function,
    three with `code_stubs`; instructions: tasks x topics) yields fewer than its share.
    `code_methods` adds the stdlib classes' documented methods to the code source,
    `code_stubs` the implement-this-stub prompts and `text_extended` the extended
    instruction kinds (the defaults, off, keep the prompts of earlier runs reproducible).
    """
    if n < 1:
        raise ValueError(f"n: must be >= 1 (got {n})")
    if len(mix) != 3 or any(not m >= 0 for m in mix) or not sum(mix) > 0:
        raise ValueError(f"mix: must be three shares >= 0 with a positive sum (got {mix!r})")
    total = sum(mix)
    mix = tuple(m / total for m in mix)
    rng = random.Random(seed)
    counts = [int(n * m) for m in mix]
    counts[0] += n - sum(counts)
    seen: set[str] = set()
    out: list[str] = []
    code = functools.partial(code_prompts, methods=code_methods, stubs=code_stubs)
    text = functools.partial(instruction_prompts, extended=text_extended)
    for source, count in zip((math_prompts, code, text), counts):
        for prompt in source(rng, count * 3):
            if len(out) >= n or count <= 0:
                break
            if prompt not in seen:
                seen.add(prompt)
                out.append(prompt)
                count -= 1
    rng.shuffle(out)
    return out
