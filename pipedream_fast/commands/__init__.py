"""CLI sub-commands; each module exposes `register(subparsers)` (see `pipedream_fast.cli`)."""
