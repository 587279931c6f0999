"""`serving.metrics.Series`: lenbatch's own counters, gauges and histograms expose exactly what
prometheus_client's own classes expose for the same updates (the reference), without
prometheus_client's per-update locks."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from lenbatch.serving.metrics import Series

BOUNDS = (0.005, 0.01, 0.1, 1.0)


def _samples(text: bytes) -> set[tuple[str, tuple[tuple[str, str], ...], float]]:
    """Every sample of an exposition but prometheus_client's `_created` timestamps."""
    out = set()
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            if not s.name.endswith("_created"):
                out.add((s.name, tuple(sorted(s.labels.items())), s.value))
    return out


def _families(text: bytes) -> list[tuple[str, str, str]]:
    """Name, type and help of every family, in order, but the `_created` ones."""
    return [
        (f.name, f.type, f.documentation)
        for f in text_string_to_metric_families(text.decode())
        if not f.name.endswith("_created")
    ]


def test_the_exposition_is_prometheus_clients_for_the_same_updates() -> None:
    ours = Series(seconds=BOUNDS)
    ref = CollectorRegistry()
    c = ours.counter("t_requests", "Requests by outcome", "bucket", "status")
    rc = Counter("t_requests", "Requests by outcome", ("bucket", "status"), registry=ref)
    g = ours.gauge("t_depth", "Queue depth", "bucket")
    rg = Gauge("t_depth", "Queue depth", ("bucket",), registry=ref)
    u = ours.gauge("t_ready", "Ready")  # without labels, never set: reads 0
    Gauge("t_ready", "Ready", registry=ref)
    h = ours.histogram("t_wait_seconds", "Queue wait", "bucket")
    rh = Histogram("t_wait_seconds", "Queue wait", ("bucket",), buckets=BOUNDS, registry=ref)
    n = ours.counter("t_refits", "Re-fits")
    rn = Counter("t_refits", "Re-fits", registry=ref)
    ours.counter("t_unused", "Never updated", "reason")  # labelled, no child: no sample
    Counter("t_unused", "Never updated", ("reason",), registry=ref)
    for ok in (True, True, False):
        status = "ok" if ok else "error"
        c.labels("1-16", status).inc()
        rc.labels("1-16", status).inc()
    c.labels("17-32", "ok").inc(3)
    rc.labels("17-32", "ok").inc(3)
    for lane, depth in (("1-16", 4), ("17-32", 2), ("1-16", 1)):
        g.labels(lane).set(depth)
        rg.labels(lane).set(depth)
    # on a bound, between bounds, above every bound
    for x in (0.005, 0.0051, 0.05, 1.0, 7.0, 0.0):
        ours.child(h, "1-16").observe(x)
        rh.labels("1-16").observe(x)
    n.inc()
    rn.inc()
    assert u.labels().value == 0.0
    assert _samples(ours.prometheus()) == _samples(generate_latest(ref))
    assert _families(ours.prometheus()) == _families(generate_latest(ref))


def test_wrong_label_counts_and_a_second_declaration_are_errors() -> None:
    s = Series()
    c = s.counter("t_requests", "Requests", "bucket", "status")
    with pytest.raises(ValueError, match="labels"):
        c.labels("1-16")
    with pytest.raises(ValueError, match="declared twice"):
        s.gauge("t_requests", "again")
