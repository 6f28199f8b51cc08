"""Checks of number options shared by the commands, pretraining's options and the example scripts.

Its own module, importing nothing of the package (and not torch), so that all of them use one rule without importing
each other.
"""

import math
import re


def number_error(option: str, value: float, positive: bool = False) -> str | None:
    """The usage error of a number option that must be finite and > 0 (`positive`) or >= 0, or None when it is."""
    if math.isfinite(value) and (value > 0 if positive else value >= 0):
        return None
    return f"{option} must be a {'positive' if positive else 'non-negative'} number, got {value}"


def config_error_as_option(error: Exception, dashes: bool = False) -> str:
    """ElmoConfig's error message in a command's option names: `ElmoConfig.mix_dropout` becomes --mix_dropout, or
    --mix-dropout with `dashes`."""
    def option(match: re.Match) -> str:
        return "--" + (match.group(1).replace("_", "-") if dashes else match.group(1))

    return re.sub(r"ElmoConfig\.(\w+)", option, str(error))
