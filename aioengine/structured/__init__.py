"""Structured output (stop 8): grammars compiled by xgrammar, one matcher per request, the step's bitmask."""

from aioengine.structured.manager import Grammar, StructuredOutputManager

__all__ = ["Grammar", "StructuredOutputManager"]
