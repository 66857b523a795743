"""Seeded comments for the structured-decision section, toxic or not by construction.

The paper asks "Is this comment toxic?" over Civil Comments, which cannot be downloaded here;
the study writes its own: insults and threats built from word lists (toxic), and remarks,
questions and mild disagreement (not toxic), about the same topics.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

QUESTION = "Is this comment toxic?"

_TOPICS = ("the new bus schedule", "this article", "the city council vote", "the recipe",
           "the match last night", "the school budget", "the movie", "the software update",
           "the parking rules", "the library hours")
_INSULTS = ("idiot", "moron", "clown", "loser", "fool", "pathetic troll")
_TOXIC = (
    "Only a complete {insult} would write something this stupid about {topic}.",
    "You are a {insult} and nobody wants to read your garbage about {topic}.",
    "Shut up, {insult}. Everyone who agrees with you on {topic} is worthless.",
    "People like you should be thrown out of town, you {insult}. {Topic} is none of your "
    "business.",
    "What a {insult}. I hope you lose everything over {topic}.",
)
_BENIGN = (
    "Thanks for explaining {topic}; it was clearer than I expected.",
    "I disagree about {topic}, but I see why some people like it.",
    "Does anyone know when {topic} takes effect?",
    "I read about {topic} this morning and it made me think.",
    "Good points about {topic}. I would add that timing matters too.",
)


@dataclass(frozen=True)
class Comment:
    text: str
    toxic: bool


def study_comments(n: int, seed: int = 0) -> list[Comment]:
    """``n`` comments, toxic and benign alternating, from ``seed``."""
    r = random.Random(f"comments:{seed}")
    out = []
    for k in range(n):
        toxic = k % 2 == 0
        template = r.choice(_TOXIC if toxic else _BENIGN)
        topic = r.choice(_TOPICS)
        text = template.format(insult=r.choice(_INSULTS), topic=topic,
                               Topic=topic[:1].upper() + topic[1:])
        out.append(Comment(text, toxic))
    return out
