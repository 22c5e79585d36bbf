"""The error every configuration problem raises (common/config/ and the modules that check a
config's values, such as common/placement.py, which config imports)."""


class ConfigError(ValueError):
    """A configuration problem, phrased for the user: which key, which value, what is allowed."""
