"""Command-line entry points and process wiring."""
