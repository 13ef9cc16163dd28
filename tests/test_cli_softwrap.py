"""Streamed text breaks at spaces at the terminal's edge, never inside a word."""

from hypothesis import given
from hypothesis import strategies as st
from rich.cells import cell_len

from kvchat.cli.softwrap import SoftWrap


def wrap(deltas: list[str], width: int) -> str:
    w = SoftWrap(width)
    return "".join(w.feed(d) for d in deltas) + w.flush()


def test_a_word_that_does_not_fit_goes_to_the_next_line():
    assert wrap([" The", " Rhine", " ends", " in", " the", " North", " Sea."], 14) == (
        " The Rhine\nends in the\nNorth Sea."
    )


def test_words_arriving_in_pieces_are_not_split():
    assert wrap(["Nether", "lands", " is", " flat"], 12) == "Netherlands\nis flat"


def test_newlines_start_a_fresh_line_and_keep_indentation():
    assert wrap(["aaaa bbbb\n", "    cc dd eeee"], 10) == "aaaa bbbb\n    cc dd\neeee"


def test_a_word_wider_than_the_line_is_written_whole_for_the_terminal_to_break():
    # On 5 columns the terminal shows "xxxxx", "xxxxx", then "xx cd": "cd" fits after the spill.
    assert wrap(["ab ", "x" * 12, " cd"], 5) == "ab\n" + "x" * 12 + " cd"
    assert wrap(["ab ", "x" * 12, " cdef"], 5) == "ab\n" + "x" * 12 + "\ncdef"


def test_indentation_that_would_push_a_word_over_the_edge_is_dropped():
    assert wrap(["      abcdef"], 10) == "abcdef"
    assert wrap(["    abcdef"], 10) == "    abcdef"


def test_wide_characters_count_as_two_columns():
    assert wrap(["日本語 日本語"], 8) == "日本語\n日本語"


words = st.text(alphabet="abcdé日", min_size=1, max_size=9)  # at most 18 columns
separators = st.sampled_from([" ", "  ", "\n", " \n", "\n   "])
texts = st.lists(st.tuples(separators, words), max_size=30).map(lambda p: "".join(s + w for s, w in p))


@given(texts, st.integers(min_value=18, max_value=40), st.data())
def test_no_line_is_wider_than_the_terminal_and_no_word_is_broken(text, width, data):
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=10)))
    deltas = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    out = wrap(deltas, width)
    assert all(cell_len(line) <= width for line in out.split("\n"))
    assert out.split() == text.split()  # the same words, in order, none cut
    assert out.count("\n") >= text.count("\n")
