"""User-facing errors: the CLI prints them as one line and exits with code 2."""


class SpecftError(Exception):
    """Bad input (config, data, cache): reported as one clear line, no traceback."""


class ConfigError(SpecftError):
    pass


class ReportedError(SpecftError):
    """A failure whose one line another process (a rank) has printed already."""
