"""Structured outputs (placeholder docstring, written below)."""

from fleetlab.structured_output.backend import (
    CompiledGrammar,
    GrammarBackend,
    GrammarError,
    GrammarMatcher,
    get_grammar_backend,
    list_grammar_backends,
    make_grammar_backend,
    register_grammar_backend,
)
from fleetlab.structured_output.params import StructuredOutputsParams

__all__ = ["CompiledGrammar", "GrammarBackend", "GrammarError", "GrammarMatcher", "StructuredOutputsParams",
           "get_grammar_backend", "list_grammar_backends", "make_grammar_backend", "register_grammar_backend"]
