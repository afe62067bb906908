"""The one base of every exception mindpulse defines, so a caller can catch all of them and
nothing else with `except MindpulseError`.

Each project exception also keeps the built-in base that says what kind of error it is
(`class ConfigError(MindpulseError, ValueError)`), so `except ValueError` still catches it.
This module imports nothing else of mindpulse: every module, the protocol and the metric
registry included, may import it.
"""

from __future__ import annotations


class MindpulseError(Exception):
    """An error raised by mindpulse's own code; the message says what to change."""
