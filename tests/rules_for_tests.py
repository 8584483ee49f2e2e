"""Reward rules used by the tests through the module:function path."""


def nan_rule(response: str, row: dict) -> float:
    return float("nan")


def response_length(response: str, row: dict) -> float:
    return float(len(row["response_token_ids"]))
