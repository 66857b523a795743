"""Structured decisions: typed questions about a state, answered with probabilities.

``noul`` (yes/no), ``choice`` and ``score`` questions each take one read of the model: the first
reply token's raw logprobs over single-token labels, renormalised (``reads``). ``LLM.decide`` and
the server's ``/v1/decisions`` and ``/v1/systemone`` share this package; the engine reads the
label logprobs batch-invariantly, so equal fingerprints give equal probabilities.
"""

from detlora.decisions.questions import Question, parse_question, parse_questions
from detlora.decisions.reads import (
    DecisionRead,
    ReadPlanner,
    answer,
    decision_messages,
    plan_reads,
    softmax,
)

__all__ = ["DecisionRead", "Question", "ReadPlanner", "answer", "decision_messages",
           "parse_question", "parse_questions", "plan_reads", "softmax"]
