"""Word wrapping for text that arrives in pieces: a streamed answer breaks at spaces, not mid-word.

A terminal wraps a long line at its last column, wherever that falls in a word. `SoftWrap` holds back
the word being written until the space after it arrives, then writes it on the current line if it
fits, else on a new one (the space it replaces is dropped). A word wider than the whole line is
written as it is, for the terminal to break.
"""

from __future__ import annotations

from rich.cells import cell_len


class SoftWrap:
    """Turns streamed deltas into text to write at `width` columns; `flush` writes what is held."""

    def __init__(self, width: int) -> None:
        self.width = max(width, 1)
        self._column = 0  # where the cursor stands on the current line
        self._spaces = ""  # spaces after the last word written, written only before the next word
        self._word = ""  # the word still arriving

    def feed(self, delta: str) -> str:
        out: list[str] = []
        for char in delta:
            if char == "\n":
                out.append(self._place_word())
                out.append("\n")
                self._column, self._spaces = 0, ""
            elif char == " ":
                out.append(self._place_word())
                self._spaces += char
            else:
                self._word += char
        return "".join(out)

    def flush(self) -> str:
        """The held word, at the end of the stream (trailing spaces are not written)."""
        text = self._place_word()
        self._spaces = ""
        return text

    def _place_word(self) -> str:
        if not self._word:
            return ""
        word_cells, space_cells = cell_len(self._word), cell_len(self._spaces)
        fits = self._column + space_cells + word_cells <= self.width
        if not fits and (self._column > 0 or word_cells <= self.width):
            # On a new line the spaces before the word go (indentation too, when it would not fit).
            text, self._column = ("\n" if self._column else "") + self._word, word_cells
        else:
            text, self._column = self._spaces + self._word, self._column + space_cells + word_cells
        if self._column > self.width:  # a word wider than the line, broken by the terminal
            self._column %= self.width
        self._spaces = self._word = ""
        return text
