"""The base of every error a user can fix. Stage entry points print these as one line naming the
file and the fix, and exit with status ``EXIT_USER_ERROR`` (2); anything else is a bug and keeps its traceback."""


class UserError(Exception):
    pass


EXIT_USER_ERROR = 2
"""The exit status of a stage process that reported a ``UserError`` (executors and the Kubernetes
Job's failure policy read it as "already reported, do not retry")."""

EXIT_PEER_LOST = 3
"""The exit status of a stage process whose peer (another rank, another host) was lost mid-stage:
not the user's input, so an executor may run the stage again, and it resumes."""
