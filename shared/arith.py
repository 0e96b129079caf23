"""Integer arithmetic of block and chunk counts."""


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative `a` by positive `b`: blocks needed for `a` tokens."""
    return -(-a // b)
