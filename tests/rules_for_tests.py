"""Reward rules used by the tests through the module:function path."""


def nan_rule(response: str, row: dict) -> float:
    return float("nan")


def response_length(response: str, row: dict) -> float:
    return float(len(row["response_token_ids"]))


def raises(response: str, row: dict) -> float:
    raise ValueError("no")


def returns_none(response: str, row: dict):
    return None


def reads_absent_column(response: str, row: dict) -> float:
    return float(row["nope"])
