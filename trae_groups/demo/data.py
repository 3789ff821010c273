"""Template-generated training data for the support demo's intent and NER heads.

The demo ships code, not a data set: templates × slot values, drawn with a seed, so
preparation is reproducible offline and a test can check the generator in
milliseconds. The test split uses templates *and* slot values that the training split
never sees, so its accuracy says something about generalisation, not memory.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

INTENTS: tuple[str, ...] = (
    "order_status",
    "refund",
    "cancel",
    "shipping_address",
    "product_question",
    "greeting",
    "complaint",
    "spam",
)
ENTITIES: tuple[str, ...] = ("ORDER_ID", "PRODUCT", "DATE", "CITY", "PERSON")
#: BIO labels, "O" first (id 0) as token-classification checkpoints usually have it.
NER_LABELS: tuple[str, ...] = ("O", *(f"{p}-{e}" for e in ENTITIES for p in ("B", "I")))

#: Slot name in a template → entity type of the text it becomes.
SLOTS: dict[str, str] = {
    "order": "ORDER_ID",
    "product": "PRODUCT",
    "date": "DATE",
    "city": "CITY",
    "person": "PERSON",
}

# Per intent, several phrasings; "{slot}" marks an entity. The last few templates of
# each intent are held out for the test split (see split_templates).
TEMPLATES: dict[str, tuple[str, ...]] = {
    "order_status": (
        "Where is my order {order}?",
        "my order {order} has not arrived yet",
        "Can you check the status of order {order}?",
        "I ordered a {product} on {date} and it still hasn't shipped",
        "When will my {product} be delivered?",
        "tracking for {order} hasn't updated since {date}",
        "is order {order} on its way to {city}?",
        "Hi, this is {person}, when does my {product} arrive?",
        "has my package {order} left the warehouse",
        "what is the delivery date for the {product} I bought on {date}?",
        "my husband {person} is asking where our {product} is",
        "order {order} says shipped but nothing came to {city}",
        "how long until the {product} gets here?",
        "Any update on the delivery of order {order} to {city}?",
        "I still haven't received the {product} I bought on {date}",
        "could you track order {order} for {person}?",
    ),
    "refund": (
        "I want a refund for order {order}",
        "please refund the {product}",
        "Can I get my money back for the {product} I bought on {date}?",
        "how do I return the {product} for a full refund",
        "refund order {order} please, it arrived damaged",
        "I returned the {product} on {date} but I have not been refunded",
        "This is {person}, I'd like a refund on order {order}",
        "when will the refund for {order} reach my account?",
        "I was charged twice for order {order}, please give me my money back",
        "I need a refund, the {product} does not work",
        "my wife {person} sent back the {product}, where is the money?",
        "please credit my card for order {order}",
        "can I return a {product} bought in {city} for cash back",
        "Could you reimburse me for the {product} from order {order}?",
        "I sent the {product} back on {date}, where is my refund?",
        "{person} here, the refund for order {order} never arrived",
    ),
    "cancel": (
        "Cancel order {order}",
        "please cancel my order {order}",
        "I want to cancel the {product} I ordered on {date}",
        "can I still cancel order {order}?",
        "I changed my mind, cancel the {product}",
        "stop my order {order} before it ships",
        "Hi, {person} here, please cancel my {product} order",
        "I need to cancel order {order}, I ordered it by mistake",
        "don't send the {product}, cancel it",
        "cancel everything I ordered on {date}",
        "my friend {person} wants to cancel order {order}",
        "I no longer want the {product}, please cancel the purchase",
        "how do I cancel an order placed on {date}?",
        "Please call off order {order}, I no longer need it",
        "I'd like to withdraw my purchase of the {product}",
        "scrap order {order} for {person}, we don't need it anymore",
    ),
    "shipping_address": (
        "please change the delivery address for order {order} to {city}",
        "I moved to {city}, can you update my shipping address?",
        "Can you ship order {order} to my new address in {city} instead?",
        "wrong address on order {order}, it should go to {city}",
        "update my address to {city} before the {product} ships",
        "send the {product} to my office in {city}",
        "This is {person}, my address changed to {city}",
        "how do I change the shipping address for {order}?",
        "deliver order {order} to {person} in {city}",
        "I need my {product} shipped to {city}, not to my old address",
        "the {product} should go to my mother {person} in {city}",
        "I entered the wrong street, order {order} must go to {city}",
        "ship it to my brother {person} in {city} please",
        "Please redirect order {order} to {city}",
        "could the {product} go to my sister {person} in {city}?",
        "change where order {order} is delivered, I live in {city} now",
    ),
    "product_question": (
        "Does the {product} come in blue?",
        "is the {product} waterproof",
        "How long is the warranty on the {product}?",
        "what size is the {product}?",
        "Is the {product} in stock in {city}?",
        "can the {product} be used outdoors",
        "does the {product} work with batteries?",
        "What colours does the {product} come in?",
        "is the {product} compatible with my phone",
        "how heavy is the {product}?",
        "what are the dimensions of the {product}",
        "is the {product} suitable for children?",
        "does the {product} have a power switch",
        "Can you tell me what material the {product} is made of?",
        "how much does the {product} cost?",
        "is the {product} dishwasher safe",
    ),
    "greeting": (
        "Hello",
        "hi there",
        "Good morning!",
        "hey, my name is {person}",
        "Hello, this is {person}",
        "hi, anyone there?",
        "Good evening, I'm {person} from {city}",
        "hey",
        "greetings!",
        "Hi, {person} here",
        "good day to you",
        "hello, I'm writing from {city}",
        "yo",
        "Good afternoon, how are you?",
        "hello there, it's {person}",
        "hi! nice to meet you",
    ),
    "complaint": (
        "The {product} I received is broken",
        "your delivery to {city} was terrible",
        "{person} from your support team was very rude",
        "this is unacceptable, order {order} arrived late and damaged",
        "I am very unhappy with the {product}",
        "the quality of the {product} is awful",
        "I've been waiting since {date} and nobody answers my emails",
        "worst service ever, order {order} is a mess",
        "the courier left my {product} in the rain",
        "I'm disappointed, the {product} looks nothing like the picture",
        "my neighbour {person} had the same problem with your {product}",
        "your agent {person} hung up on me",
        "the box for order {order} was crushed and the {product} scratched",
        "Your driver in {city} threw my package over the fence",
        "I'm fed up, {person} promised a call back on {date} and never called",
        "the {product} stopped working after one day, this is ridiculous",
    ),
    "spam": (
        "WIN a FREE iPhone now!!! click here",
        "Cheap meds online, no prescription needed",
        "earn $5000 a week working from home",
        "You have been selected for a cash prize, reply with your bank details",
        "buy followers cheap, best prices",
        "Congratulations, you won a lottery! send a fee to claim",
        "hot singles in your area",
        "limited offer: crypto investment with 300% returns",
        "click this link to unlock your account http://bit.ly/xyz",
        "lose 20 pounds in 3 days with this one trick",
        "best replica watches, huge discount today",
        "URGENT: your parcel is held, pay the customs fee at www.parcel-fee.biz",
        "get rich quick with our forex robot",
        "FREE gift card!!! act now before it expires",
        "make money fast, visit our casino today",
        "dear friend, I need your help moving 10 million dollars",
    ),
}
HELD_OUT_TEMPLATES = 3

PRODUCTS: tuple[str, ...] = (
    "wireless headphones", "running shoes", "coffee maker", "yoga mat", "laptop stand",
    "desk lamp", "phone case", "backpack", "electric kettle", "bluetooth speaker",
    "water bottle", "winter jacket", "gaming mouse", "mechanical keyboard", "smart watch",
    "blender", "air fryer", "office chair", "sunglasses", "tablet", "hair dryer",
    "camping tent", "toaster", "usb charger", "monitor", "vacuum cleaner", "rain boots",
    "frying pan", "fitness tracker", "wool scarf", "baby stroller", "bike helmet",
    "espresso machine", "sofa cushion", "travel mug", "tennis racket", "webcam",
    "table fan", "leather wallet", "kids bicycle", "noise cancelling headphones",
    "stainless steel water bottle", "standing desk", "rice cooker", "garden hose",
    "electric toothbrush", "bed sheets", "hiking backpack", "digital camera", "printer",
    "coffee grinder", "dining table", "floor lamp", "pressure cooker", "wireless earbuds",
    "memory foam pillow", "phone charger", "drone", "kitchen scale", "ski jacket",
)  # fmt: skip
CITIES: tuple[str, ...] = (
    "Paris", "London", "Berlin", "Madrid", "Rome", "Chicago", "Boston", "Seattle",
    "Toronto", "Sydney", "Dublin", "Lisbon", "Vienna", "Prague", "Warsaw", "Oslo",
    "Stockholm", "Denver", "Austin", "Miami", "Tokyo", "Osaka", "Seoul", "Mumbai",
    "Cape Town", "Nairobi", "Lima", "Bogota", "Montreal", "Amsterdam", "Brussels",
    "Zurich", "Munich", "Hamburg", "Milan", "Athens", "Helsinki", "Copenhagen",
    "San Francisco", "New York", "Los Angeles", "Rio de Janeiro", "Buenos Aires",
    "Hong Kong", "Mexico City", "Kuala Lumpur", "Porto", "Krakow", "Marseille", "Lyon",
    "Edinburgh", "Manchester", "Glasgow", "Vancouver", "Melbourne", "Auckland",
)  # fmt: skip
FIRST_NAMES: tuple[str, ...] = (
    "Anna", "John", "Maria", "David", "Sarah", "Michael", "Emma", "Lucas", "Sophie",
    "James", "Olivia", "Daniel", "Laura", "Thomas", "Chloe", "Peter", "Nina", "Carlos",
    "Hannah", "Oliver", "Mia", "Ethan", "Grace", "Noah", "Lena", "Paul", "Yuki", "Omar",
    "Fatima", "Ravi", "Elena", "Marco", "Julia", "Kevin", "Amira", "Tom", "Isabel",
    "Victor", "Lisa", "Ben", "Ahmed", "Sofia", "Jan", "Pierre", "Akira", "Zoe", "Liam",
    "Priya", "Chen", "Eva", "Mateo", "Ingrid", "George", "Aisha", "Robert", "Kim", "Sam",
)  # fmt: skip
LAST_NAMES: tuple[str, ...] = (
    "Smith", "Johnson", "Brown", "Wilson", "Garcia", "Martin", "Ruiz", "Lee", "Davis",
    "Tanaka", "Patel", "Schmidt", "Hugo", "Carter", "Rossi", "Hassan", "Kowalski",
    "Dubois", "Miller", "O'Brien", "Wei", "Novak", "Larsen", "Bello", "Taylor", "Lewis",
    "Nguyen", "Müller", "Silva", "Jensen", "Khan", "Murphy", "Costa", "Ivanova", "Park",
)  # fmt: skip
MONTHS: tuple[str, ...] = (
    "January", "February", "March", "April", "May", "June", "July", "August",
    "September", "October", "November", "December",
)  # fmt: skip
RELATIVE_DATES: tuple[str, ...] = (
    "yesterday", "last Monday", "last week", "two weeks ago", "last Friday",
    "three days ago", "last month", "Tuesday", "the weekend", "Christmas Eve",
)  # fmt: skip

_SLOT = re.compile(r"\{(\w+)\}")


@dataclass(frozen=True)
class Example:
    """One utterance with its intent and entity spans (start, end, type), char offsets."""

    text: str
    intent: str
    spans: tuple[tuple[int, int, str], ...]


@dataclass(frozen=True)
class Dataset:
    train: list[Example]
    test: list[Example]


def _split(values: Sequence[str], rng: random.Random, held_out: float) -> tuple[list, list]:
    shuffled = list(values)
    rng.shuffle(shuffled)
    cut = max(1, round(len(shuffled) * held_out))
    return shuffled[cut:], shuffled[:cut]


def _dates(rng: random.Random) -> list[str]:
    days = [f"{m} {d}" for m in MONTHS for d in (1, 3, 8, 12, 15, 21, 28)]
    days += [f"{m} {d}th" for m in MONTHS for d in (4, 9, 14, 17, 25)]
    days += [f"{d:02d}/{m:02d}/2024" for m in range(1, 13) for d in (2, 11, 19, 26)]
    days += list(RELATIVE_DATES)
    rng.shuffle(days)
    return days


def _order_id(rng: random.Random) -> str:
    digits = "".join(rng.choice("0123456789") for _ in range(rng.choice((5, 6, 7))))
    letters = "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ") for _ in range(rng.choice((1, 2, 3))))
    style = rng.randrange(4)
    if style == 0:
        return f"#{digits}"
    if style == 1:
        return f"{letters}{digits}"
    if style == 2:
        return f"{letters}-{digits}"
    return digits


def _person(pool: dict[str, list[str]], rng: random.Random) -> str:
    """A first name, or first and last: many two-word names teach B- then I- tags."""
    first = rng.choice(pool["first"])
    return f"{first} {rng.choice(pool['last'])}" if rng.random() < 0.5 else first


def render(template: str, values: dict[str, str], intent: str) -> Example:
    """Fill a template's slots, keeping the character span of every entity."""
    text, spans, pos = "", [], 0
    for match in _SLOT.finditer(template):
        text += template[pos : match.start()]
        slot = match.group(1)
        value = values[slot]
        spans.append((len(text), len(text) + len(value), SLOTS[slot]))
        text += value
        pos = match.end()
    text += template[pos:]
    return Example(text=text, intent=intent, spans=tuple(spans))


def _vary(example: Example, rng: random.Random) -> Example:
    """Surface noise (case, a greeting prefix, punctuation) so the heads learn words,
    not the exact template string."""
    text, spans = example.text, list(example.spans)
    roll = rng.random()
    if roll < 0.15:
        text = text.lower()
    elif roll < 0.25 and text[:1].isalpha():
        text = text[0].upper() + text[1:]
    if example.intent not in ("greeting", "spam") and rng.random() < 0.15:
        prefix = rng.choice(("Hi, ", "Hello, ", "hey ", "Excuse me, ", "Good morning, "))
        if text[1:2].islower():  # "Hi, where is..." not "Hi, Where is..."
            text = text[0].lower() + text[1:]
        text = prefix + text
        spans = [(s + len(prefix), e + len(prefix), t) for s, e, t in spans]
    if rng.random() < 0.2 and text[-1:] not in "?!.":
        text += rng.choice((".", "!", "?", " please", " thanks"))
    # Changing case never changes lengths, so the spans still hold.
    return Example(text=text, intent=example.intent, spans=tuple(spans))


def _pools(rng: random.Random, held_out: float) -> tuple[dict, dict]:
    train, test = {}, {}
    for slot, values in {
        "product": PRODUCTS,
        "city": CITIES,
        "first": FIRST_NAMES,
        "last": LAST_NAMES,
        "date": _dates(rng),
    }.items():
        train[slot], test[slot] = _split(values, rng, held_out)
    return train, test


def _draw(
    n: int, templates: dict[str, list[str]], pool: dict[str, list[str]], rng: random.Random
) -> list[Example]:
    out: list[Example] = []
    intents = list(templates)
    for i in range(n):
        intent = intents[i % len(intents)]  # balanced classes
        template = rng.choice(templates[intent])
        values = {slot: rng.choice(pool[slot]) for slot in ("product", "city", "date")}
        values["order"] = _order_id(rng)
        values["person"] = _person(pool, rng)
        out.append(_vary(render(template, values, intent), rng))
    rng.shuffle(out)
    return out


def split_templates(held_out: int = HELD_OUT_TEMPLATES) -> tuple[dict, dict]:
    """(train, test) templates per intent: the last `held_out` of each are test-only."""
    train = {k: list(v[:-held_out]) for k, v in TEMPLATES.items()}
    test = {k: list(v[-held_out:]) for k, v in TEMPLATES.items()}
    return train, test


def make_dataset(seed: int = 0, n_train: int = 1600, n_test: int = 400) -> Dataset:
    """A seeded train/test split; the same seed gives the same examples."""
    rng = random.Random(seed)
    train_pool, test_pool = _pools(rng, held_out=0.25)
    train_templates, test_templates = split_templates()
    return Dataset(
        train=_draw(n_train, train_templates, train_pool, rng),
        test=_draw(n_test, test_templates, test_pool, rng),
    )
