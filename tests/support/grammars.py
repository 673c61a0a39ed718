"""Hypothesis strategies for hostile constraints: Lark grammars (chained, recursive, ambiguous,
deeply nested), regexes (nested repetitions with large counts) and JSON schemas (recursive
`$ref`s, unions, nested arrays and objects)."""

from __future__ import annotations

from hypothesis import strategies as st

_TERMINAL = st.sampled_from(['"a"', '"b"', '"ab"', '/[0-9]+/', '"{"', '"}"'])


@st.composite
def lark_grammars(draw: st.DrawFn) -> str:
    rules = draw(st.integers(1, 40))

    def expression(depth: int) -> st.SearchStrategy[str]:
        atom = st.one_of(_TERMINAL, st.integers(0, rules - 1).map(lambda r: f"r{r}"))
        if depth == 0:
            return atom
        inner = expression(depth - 1)
        return st.one_of(
            atom,
            st.lists(inner, min_size=1, max_size=3).map(" ".join),
            st.lists(inner, min_size=2, max_size=3).map(lambda xs: "(" + " | ".join(xs) + ")"),
            st.tuples(inner, st.sampled_from("*+?")).map(lambda t: f"({t[0]}){t[1]}"))

    body = [draw(expression(draw(st.integers(0, 4)))) for _ in range(rules)]
    nest = draw(st.integers(0, 300))  # deeply nested parentheses around the start
    return "\n".join(["start: " + "(" * nest + "r0" + ")" * nest,
                      *(f"r{i}: {b}" for i, b in enumerate(body))])


_REGEX = st.recursive(
    st.sampled_from(["a", "b", "[0-9]", "[a-z]", r"\d", ".", "x"]),
    lambda inner: st.one_of(
        st.tuples(inner, inner).map("".join),
        st.tuples(inner, inner).map(lambda t: f"({t[0]}|{t[1]})"),
        st.tuples(inner, st.integers(0, 1200), st.integers(0, 1200)).map(
            lambda t: f"({t[0]}){{{min(t[1], t[2])},{max(t[1], t[2])}}}"),
        inner.map(lambda r: f"({r})*")),
    max_leaves=12)


_SCHEMA = st.recursive(
    st.sampled_from([{"type": "string"}, {"type": "integer", "minimum": 0}, {"type": "boolean"},
                     {"enum": ["x", "y"]}, {"type": "string", "pattern": "^[a-c]{2,4}$"},
                     {"$ref": "#"}]),
    lambda inner: st.one_of(
        st.dictionaries(st.sampled_from("abcdef"), inner, max_size=4).map(
            lambda p: {"type": "object", "properties": p}),
        inner.map(lambda i: {"type": "array", "items": i, "maxItems": 3}),
        st.lists(inner, min_size=2, max_size=3).map(lambda xs: {"anyOf": xs})),
    max_leaves=15)



LARK_GRAMMARS = lark_grammars()
REGEXES = _REGEX
SCHEMAS = _SCHEMA
