"""User-facing errors: the CLI prints them as one line and exits with code 2."""


class SpecftError(Exception):
    """Bad input (config, data, cache): reported as one clear line, no traceback."""


class ConfigError(SpecftError):
    pass


class NoConversations(SpecftError):
    """The data gave no usable conversation; ``summary`` counts why (a command with a
    narrower use of the data may say it in its own words)."""

    def __init__(self, message: str, summary=None):
        super().__init__(message)
        self.summary = summary


class ReportedError(SpecftError):
    """A failure whose one line another process (a rank) has printed already."""


def first_line(err: BaseException, default: str = "", limit: int = 200) -> str:
    """The first line of an exception's message, cut to ``limit``: what a one-line
    refusal quotes of a library's error (``default`` when it says nothing)."""
    text = str(err).strip()
    return text.splitlines()[0][:limit] if text else default
