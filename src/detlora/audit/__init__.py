"""The audit log: one JSON line per finished request or decision (``format``), written off the
serving path by a background thread (``writer``), read back line by line (``reader``), and
replayed bit for bit by ``detlora verify`` (``verify``). docs/design.md, "The audit log",
documents the format field by field.

This ``__init__`` imports nothing, so the engine-side modules do not pull in the replay's
(which sits above the public API)."""
