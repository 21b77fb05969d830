"""Reading an OpenTelemetry InMemoryMetricReader in tests."""


def metric_points(reader) -> dict:
    """metric name -> its data points."""
    out = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                out[m.name] = list(m.data.data_points)
    return out
