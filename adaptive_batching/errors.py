"""The error every config check raises."""


class ConfigError(ValueError):
    """A config value is wrong; the message names the key and what is allowed."""
