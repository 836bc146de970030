TYPE_CODES: dict[str, int]
