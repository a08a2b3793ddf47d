"""Errors that mean "the user gave bad input": the CLI prints them on one line, exit 2."""


class UserInputError(ValueError):
    """Bad user input (data file, prompt, weights); the message names the field and place."""
