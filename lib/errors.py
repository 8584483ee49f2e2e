"""The base of every error a user can fix. Stage entry points print these as one line naming the
file and the fix, and exit with status 2; anything else is a bug and keeps its traceback."""


class UserError(Exception):
    pass
