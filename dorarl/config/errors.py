"""`ConfigError`: a user error in a config file or override, its message naming the key."""


class ConfigError(ValueError):
    """A user error in a config file or override; the message names the key."""
