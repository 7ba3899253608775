"""Arithmetic and algebra word problems with step-by-step solutions, generated deterministically.

`problem(rng)` draws a template, numbers, names and phrasing from `rng` and returns the question
and its worked solution, which always ends with "The answer is N." Every number is computed, never
typed, so the solutions are correct by construction.
"""

from __future__ import annotations

import random
from fractions import Fraction
from typing import Callable

NAMES = ["Ava", "Ben", "Chloe", "Dev", "Elena", "Farid", "Grace", "Hiro", "Isla", "Jonas", "Kira", "Liam", "Maya",
         "Noah", "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tara", "Uma", "Victor", "Wen", "Yusuf", "Zoe"]
ITEMS = [("apple", "apples"), ("notebook", "notebooks"), ("pencil", "pencils"), ("ticket", "tickets"),
         ("sticker", "stickers"), ("marble", "marbles"), ("cookie", "cookies"), ("book", "books"), ("plant", "plants")]
OPENERS = ["", "Here is a problem. ", "Solve this: ", "Question: ", "Can you help with this? "]


def shopping(rng: random.Random) -> tuple[str, list[str], int]:
    name, (_, many) = rng.choice(NAMES), rng.choice(ITEMS)
    count, price, paid_extra = rng.randint(2, 12), rng.randint(1, 9), rng.randint(1, 20)
    budget = count * price + paid_extra
    question = f"{name} buys {count} {many} at ${price} each and pays with ${budget}. How much change does {name} get?"
    steps = [
        f"The {many} cost {count} × ${price} = ${count * price}.",
        f"The change is ${budget} − ${count * price} = ${paid_extra}.",
    ]
    return question, steps, paid_extra


def sharing(rng: random.Random) -> tuple[str, list[str], int]:
    name, (_, many) = rng.choice(NAMES), rng.choice(ITEMS)
    friends, each, left = rng.randint(2, 9), rng.randint(2, 15), rng.randint(0, 1)
    total = friends * each + left * rng.randint(1, friends - 1)
    share, remainder = divmod(total, friends)
    question = (
        f"{name} has {total} {many} and shares them equally among {friends} friends. How many does each friend get?"
    )
    steps = [
        f"Divide {total} by {friends}: {total} ÷ {friends} = {share}"
        + (f" with {remainder} left over." if remainder else ".")
    ]
    return question, steps, share


def rate(rng: random.Random) -> tuple[str, list[str], int]:
    speed, hours = rng.choice([30, 40, 45, 50, 55, 60, 65, 72, 80]), rng.randint(2, 9)
    vehicle = rng.choice(["car", "train", "bus", "truck"])
    question = f"A {vehicle} travels at {speed} km per hour for {hours} hours. How far does it go?"
    steps = [f"Distance = speed × time = {speed} × {hours} = {speed * hours} km."]
    return question, steps, speed * hours


def ages(rng: random.Random) -> tuple[str, list[str], int]:
    a, b = rng.sample(NAMES, 2)
    age_b, gap, years = rng.randint(3, 40), rng.randint(2, 30), rng.randint(2, 15)
    question = f"{a} is {gap} years older than {b}. {b} is {age_b}. How old will {a} be in {years} years?"
    steps = [
        f"{a} is now {age_b} + {gap} = {age_b + gap}.",
        f"In {years} years {a} will be {age_b + gap} + {years} = {age_b + gap + years}.",
    ]
    return question, steps, age_b + gap + years


def rectangle(rng: random.Random) -> tuple[str, list[str], int]:
    width, length = rng.randint(2, 30), rng.randint(2, 30)
    thing = rng.choice(["garden", "room", "field", "poster", "table top"])
    if rng.random() < 0.5:
        question = f"A rectangular {thing} is {length} m long and {width} m wide. What is its area?"
        return (
            question,
            [f"Area = length × width = {length} × {width} = {length * width} square metres."],
            length * width,
        )
    question = f"A rectangular {thing} is {length} m long and {width} m wide. What is its perimeter?"
    steps = [
        f"Perimeter = 2 × (length + width) = 2 × ({length} + {width}) = 2 × {length + width} = "
        f"{2 * (length + width)} m."
    ]
    return question, steps, 2 * (length + width)


def percent(rng: random.Random) -> tuple[str, list[str], int]:
    pct, base = rng.choice([10, 20, 25, 30, 40, 50, 75]), rng.randint(2, 40) * 20
    name = rng.choice(NAMES)
    off = base * pct // 100
    question = f"A jacket costs ${base}. {name} gets a {pct}% discount. What is the sale price?"
    steps = [
        f"The discount is {pct}% of ${base} = {pct}/100 × {base} = ${off}.",
        f"The sale price is ${base} − ${off} = ${base - off}.",
    ]
    return question, steps, base - off


def linear_equation(rng: random.Random) -> tuple[str, list[str], int]:
    x, a, b = rng.randint(-12, 15), rng.randint(2, 9), rng.randint(-20, 20)
    c = a * x + b
    sign = "+" if b >= 0 else "−"
    question = f"Solve for x: {a}x {sign} {abs(b)} = {c}."
    move = f"Subtract {b} from both sides" if b >= 0 else f"Add {-b} to both sides"
    steps = [
        f"{move}: {a}x = {c} {'−' if b >= 0 else '+'} {abs(b)} = {c - b}.",
        f"Divide both sides by {a}: x = {c - b} ÷ {a} = {x}.",
    ]
    return question, steps, x


def fractions(rng: random.Random) -> tuple[str, list[str], int]:
    whole, denominator = rng.randint(2, 20) * 12, rng.choice([2, 3, 4, 6, 12])
    numerator = rng.randint(1, denominator - 1)
    part = Fraction(numerator, denominator) * whole
    name, (_, many) = rng.choice(NAMES), rng.choice(ITEMS)
    question = f"{name} had {whole} {many} and gave away {numerator}/{denominator} of them. How many are left?"
    steps = [f"{numerator}/{denominator} of {whole} is {whole} ÷ {denominator} × {numerator} = {part}.",
             f"Left: {whole} − {part} = {whole - part}."]
    return question, steps, int(whole - part)


def multi_step(rng: random.Random) -> tuple[str, list[str], int]:
    name = rng.choice(NAMES)
    boxes, per_box, eaten, friends = rng.randint(2, 8), rng.randint(4, 12), rng.randint(1, 5), rng.randint(2, 4)
    total = boxes * per_box
    remaining = total - eaten
    remaining -= remaining % friends  # keep the final division exact
    eaten = total - remaining
    question = (f"{name} bought {boxes} boxes of cookies with {per_box} cookies in each box, ate {eaten} of them, "
                f"and split the rest equally among {friends} friends. How many cookies did each friend get?")
    steps = [
        f"Total cookies: {boxes} × {per_box} = {total}.",
        f"After eating {eaten}: {total} − {eaten} = {remaining}.",
        f"Each friend gets {remaining} ÷ {friends} = {remaining // friends}.",
    ]
    return question, steps, remaining // friends


def arithmetic(rng: random.Random) -> tuple[str, list[str], int]:
    a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 12)
    question = f"What is ({a} + {b}) × {c}?"
    steps = [f"First the parentheses: {a} + {b} = {a + b}.", f"Then multiply: {a + b} × {c} = {(a + b) * c}."]
    return question, steps, (a + b) * c


def savings(rng: random.Random) -> tuple[str, list[str], int]:
    name, weekly, goal_weeks, start = rng.choice(NAMES), rng.randint(3, 25), rng.randint(3, 12), rng.randint(0, 50)
    goal = start + weekly * goal_weeks
    question = f"{name} has ${start} and saves ${weekly} each week. How many weeks until {name} has ${goal}?"
    steps = [
        f"{name} still needs ${goal} − ${start} = ${goal - start}.",
        f"At ${weekly} a week that takes {goal - start} ÷ {weekly} = {goal_weeks} weeks.",
    ]
    return question, steps, goal_weeks


TEMPLATES: list[Callable[[random.Random], tuple[str, list[str], int]]] = [
    shopping, sharing, rate, ages, rectangle, percent, linear_equation, fractions, multi_step, arithmetic, savings,
]


def problem(rng: random.Random) -> tuple[str, str]:
    """One word problem and its step-by-step solution."""
    question, steps, answer = rng.choice(TEMPLATES)(rng)
    lead = rng.choice(["", "Let's work it out step by step.\n", "Step by step:\n"])
    solution = lead + "\n".join(steps) + f"\nThe answer is {answer}."
    return rng.choice(OPENERS) + question, solution
