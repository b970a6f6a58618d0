"""Placeholder: commands are added here."""

COMMANDS: list = []
