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

EXIT_STATUS_ENV = "LLAMARL_EXIT_STATUS_FILE"
"""Set by a launcher that stands between the stage's processes and its own exit status — torchrun
in a Kubernetes pod exits 1 whatever its workers did — to a file where each failed process
appends ``STATUS ERROR``, so that the launcher can exit with the stage's own status (a user error
must fail the stage at once, not be retried)."""
