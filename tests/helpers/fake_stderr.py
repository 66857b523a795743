"""A stderr for tests of progress bars, which draw only on a terminal."""

from __future__ import annotations

import io


class FakeStderr(io.StringIO):
    """A stderr that says whether it is a terminal, whatever pytest's capture is."""

    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty
