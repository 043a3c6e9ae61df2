"""`require_int`: the range check the config dataclasses (`BlockSpec`, `TieredStoreConfig`,
`engine.engine.EngineConfig`, `router.config.RouterConfig`) share. No torch: the router uses it."""

from __future__ import annotations


def require_int(name: str, value: object, *, minimum: int = 1, maximum: int | None = None) -> None:
    """Return if ``value`` is an int (a bool is not) in ``[minimum, maximum]``.

    Raises:
        ValueError: ``"{name} must be a positive integer, got …"`` (minimum 1, no maximum), ``"… an
            integer >= {minimum}, …"`` or ``"… an integer in [{minimum}, {maximum}], …"``.
    """
    if isinstance(value, int) and not isinstance(value, bool) and value >= minimum and (
            maximum is None or value <= maximum):
        return
    if maximum is not None:
        wanted = f"an integer in [{minimum}, {maximum}]"
    else:
        wanted = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
    raise ValueError(f"{name} must be {wanted}, got {value!r}")
