"""Seeded synthetic user profiles: a few dozen facts, each answerable by one short value.

Every field has a pool of values; a profile draws one per field. A question about a field
is answered by its value, and the distractors are other values of the same pool, so an
arm's answer is scored by comparing the candidates' log-probabilities (see ``cases``).
An update (a new profile version) bumps the version line at the top and redraws a few
facts: the profile block then differs from its first line on.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class Field:
    key: str
    label: str
    """How the profile names it: ``- {label}: {value}``."""
    question: str
    """The user's question, first person."""
    stub: str
    """The assistant's reply, opened up to the value (the value follows after a space)."""
    pool: tuple[str, ...]


def _pool(text: str) -> tuple[str, ...]:
    return tuple(text.split())


FIELDS: tuple[Field, ...] = (
    Field("first_name", "First name", "What is my first name?", "Your first name is",
          _pool("Amara Bruno Chiara Dmitri Elena Farid Greta Hiroshi Ingrid Jonas Leona "
                "Mateo Nadia Oskar Priya Rafael")),
    Field("surname", "Surname", "What is my surname?", "Your surname is",
          _pool("Okafor Lindqvist Moreau Tanaka Kowalski Fernandes Haddad Novak Brennan "
                "Castillo Petrov Jansen Oyelaran Schmidt")),
    Field("city", "City", "Which city do I live in?", "You live in",
          _pool("Lisbon Oslo Nairobi Montreal Osaka Krakow Melbourne Edinburgh Hanoi "
                "Seville Winnipeg Tbilisi Porto Dublin")),
    Field("employer", "Employer", "Which company do I work for?", "You work for",
          _pool("Siemens Nestle Spotify Airbus Maersk Lego Philips Ikea Nokia Heineken "
                "Toyota Adidas Ericsson Unilever")),
    Field("job", "Job", "What is my job?", "You work as a",
          _pool("nurse architect pilot chemist plumber librarian accountant baker "
                "electrician geologist translator veterinarian")),
    Field("pet", "Pet", "What kind of pet do I have?", "Your pet is a",
          _pool("parrot hamster tortoise rabbit ferret beagle goldfish iguana poodle "
                "canary chinchilla gecko")),
    Field("pet_name", "Pet's name", "What is my pet called?", "Your pet is called",
          _pool("Biscuit Pepper Ziggy Noodle Luna Waffles Gizmo Pickles Olive Toffee "
                "Rocket Clover")),
    Field("food", "Favourite food", "What is my favourite food?", "Your favourite food is",
          _pool("sushi lasagna paella ramen tacos curry goulash falafel pierogi moussaka "
                "risotto dumplings")),
    Field("allergy", "Allergy", "What am I allergic to?", "You are allergic to",
          _pool("peanuts shellfish penicillin pollen gluten latex sesame soy eggs "
                "strawberries wasps")),
    Field("language", "Preferred language", "Which language do I prefer?",
          "You prefer to speak",
          _pool("Portuguese Norwegian Swahili French Japanese Polish Greek Italian Turkish "
                "Dutch Korean Hindi")),
    Field("colour", "Favourite colour", "What is my favourite colour?",
          "Your favourite colour is",
          _pool("teal maroon violet amber indigo coral beige magenta turquoise crimson "
                "lavender")),
    Field("hobby", "Hobby", "What is my hobby?", "Your hobby is",
          _pool("pottery chess knitting climbing birdwatching origami fencing gardening "
                "surfing woodworking juggling calligraphy")),
    Field("sport", "Sport followed", "Which sport do I follow?", "You follow",
          _pool("cricket rugby hockey volleyball tennis basketball baseball badminton "
                "handball sailing cycling")),
    Field("instrument", "Instrument", "Which instrument do I play?", "You play the",
          _pool("cello banjo trumpet harp accordion violin clarinet ukulele drums flute "
                "saxophone piano")),
    Field("music", "Music genre", "What music do I like?", "You like",
          _pool("jazz reggae techno opera bluegrass salsa punk blues flamenco disco")),
    Field("drink", "Favourite drink", "What is my favourite drink?", "Your favourite drink is",
          _pool("espresso kombucha lemonade matcha cider chai cocoa smoothie mojito "
                "ginger")),
    Field("car", "Car", "Which car brand do I drive?", "You drive a",
          _pool("Volvo Subaru Tesla Fiat Peugeot Mazda Skoda Kia Renault Honda Jeep")),
    Field("birth_month", "Birth month", "In which month was I born?", "You were born in",
          _pool("January February March April May June July August September October "
                "November December")),
    Field("university", "University", "Where did I study?", "You studied at",
          _pool("Harvard Oxford Stanford Cambridge Yale Sorbonne Heidelberg Princeton "
                "Bologna Uppsala Leiden")),
    Field("fruit", "Favourite fruit", "What is my favourite fruit?", "Your favourite fruit is",
          _pool("mango papaya kiwi lychee plum cherry apricot fig pear guava")),
    Field("holiday", "Next holiday", "Where am I going on holiday?", "You are going to",
          _pool("Iceland Morocco Peru Croatia Vietnam Chile Norway Egypt Mexico Kenya "
                "Jordan")),
    Field("partner", "Partner's name", "What is my partner's name?",
          "Your partner's name is",
          _pool("Tomas Ines Yusuf Maren Callum Sofia Anton Beatriz Kenji Lucia Emeka")),
    Field("child", "Child's name", "What is my child's name?", "Your child's name is",
          _pool("Milo Freya Arjun Zoe Felix Hana Leo Ada Theo Nina Omar")),
    Field("code", "Programming language", "Which programming language do I use?",
          "You use",
          _pool("Python Rust Haskell Kotlin Ruby Perl Fortran Scala Elixir Julia Swift")),
    Field("flower", "Favourite flower", "What is my favourite flower?",
          "Your favourite flower is the",
          _pool("tulip orchid daisy rose lily sunflower peony iris lotus magnolia")),
    Field("film", "Film genre", "What kind of films do I watch?", "You watch",
          _pool("westerns documentaries thrillers musicals comedies cartoons horror "
                "romance")),
    Field("diet", "Diet", "What diet do I follow?", "You follow a",
          _pool("vegan vegetarian pescatarian keto halal kosher paleo")),
    Field("gym_day", "Gym day", "On which day do I go to the gym?", "You go to the gym on",
          _pool("Monday Tuesday Wednesday Thursday Friday Saturday Sunday")),
    Field("airline", "Airline", "Which airline do I fly with?", "You fly with",
          _pool("Lufthansa Emirates KLM Qantas Iberia Finnair Ryanair Aeroflot Delta "
                "Alitalia")),
    Field("tea", "Tea", "Which tea do I drink?", "You drink",
          _pool("oolong rooibos chamomile jasmine darjeeling sencha peppermint hibiscus")),
    Field("shoe", "Shoe brand", "Which shoe brand do I wear?", "You wear",
          _pool("Nike Puma Reebok Asics Converse Vans Skechers Fila Salomon")),
    Field("newspaper", "Newspaper", "Which newspaper do I read?", "You read the",
          _pool("Guardian Times Economist Observer Telegraph Herald Tribune Independent")),
)  # fmt: skip
FIELD_BY_KEY = {f.key: f for f in FIELDS}


@dataclass(frozen=True, slots=True)
class Profile:
    """One version of one user's profile."""

    user: int
    version: int
    date: str
    facts: tuple[tuple[str, str], ...]
    """(field key, value) in the order the profile lists them."""

    def value(self, key: str) -> str:
        return dict(self.facts)[key]

    def render(self) -> str:
        """The profile as a system message of its own (the block placed early or late)."""
        lines = "\n".join(f"- {FIELD_BY_KEY[k].label}: {v}" for k, v in self.facts)
        return (
            f"<|im_start|>system\nUser memory, profile version {self.version} (updated "
            f"{self.date}). Facts about the user you are working for:\n{lines}<|im_end|>\n"
        )


def _date(rng: random.Random) -> str:
    return f"2024-{rng.randrange(1, 13):02d}-{rng.randrange(1, 29):02d}"


def make_profile(facts: int, seed: int, user: int) -> Profile:
    """User ``user``'s first profile: ``facts`` fields (a seeded subset, shuffled), one
    value each."""
    if not 1 <= facts <= len(FIELDS):
        raise ValueError(f"a profile has 1 to {len(FIELDS)} facts, not {facts}")
    rng = random.Random(f"memory:{seed}:profile:{user}")
    fields = rng.sample(FIELDS, facts)
    pairs = tuple((f.key, rng.choice(f.pool)) for f in fields)
    return Profile(user, rng.randrange(2, 40), _date(rng), pairs)


def update(profile: Profile, changes: int, seed: int) -> tuple[Profile, tuple[str, ...]]:
    """The next version: ``changes`` facts redrawn (each to another value), a new date.
    Returns it and the keys that changed."""
    rng = random.Random(f"memory:{seed}:update:{profile.user}:{profile.version}")
    keys = [k for k, _ in profile.facts]
    changed = set(rng.sample(keys, min(changes, len(keys))))
    facts = tuple(
        (k, rng.choice([v2 for v2 in FIELD_BY_KEY[k].pool if v2 != v]) if k in changed else v)
        for k, v in profile.facts
    )
    new = replace(profile, version=profile.version + 1, date=_date(rng), facts=facts)
    return new, tuple(k for k in keys if k in changed)
