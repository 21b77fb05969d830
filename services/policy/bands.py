"""Criticality bands: strict priority between classes of requests, pure (no I/O).

Every request belongs to one band, from its criticality (the gRPC field `criticality`, the OpenAI extension field
of the same name, or the `x-criticality` header: services.common.request.with_headers): critical, standard (the
default) or sheddable. As in the Gateway API Inference Extension, a negative priority also marks a request
sheddable. Bands are strict: no request of a band is dispatched, admitted to a batch slot or kept running while a
request of a more urgent band waits for that slot (services.policy.arbitration orders by band before any policy's
own order, and preempts across bands), and under overload the least urgent band's newest requests are pushed out
of the admission queue first (services.policy.admission_queue). Inside a band the configured policy shares between
tenants (VTC for the fair ones) and orders within a tenant (FCFS or earliest deadline).
"""

from __future__ import annotations

from services.common.errors import InvalidRequest

CRITICAL, STANDARD, SHEDDABLE = 0, 1, 2
NAMES = ("critical", "standard", "sheddable")  # by band
BANDS = range(len(NAMES))


def band_of(criticality: str = "", priority: int = 0) -> int:
    """The band of a request: its criticality by name ("" = standard, or sheddable when priority < 0)."""
    name = criticality.strip().lower()
    if not name:
        return SHEDDABLE if priority < 0 else STANDARD
    if name not in NAMES:
        raise InvalidRequest(f"criticality must be one of {', '.join(NAMES)}; got {criticality[:40]!r}")
    if priority < 0 and name != "sheddable":
        raise InvalidRequest(f"a negative priority marks a request sheddable; it cannot also be {name!r}")
    return NAMES.index(name)


def band_name(band: int) -> str:
    return NAMES[band] if 0 <= band < len(NAMES) else str(band)
