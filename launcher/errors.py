"""The one exception type the command line turns into a clean message."""


class LauncherError(Exception):
    """A problem the user can fix; the message says what is wrong and how to fix it."""
