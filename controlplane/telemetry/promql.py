"""PromQL, built from checked parts: the queries every telemetry read and every alert rule runs on
Prometheus, and the durations and quoted strings its configuration shares with them.

Where it sits: :class:`~controlplane.telemetry.prometheus.PrometheusSource` sends these queries,
``alerts/rules.py`` writes them into Prometheus rule files, and the in-process scraper answers the same
questions with the same arithmetic (the PromQL agreement tests compare the two);
:mod:`controlplane.telemetry.prometheus_server` writes its ``prometheus.yml`` with :func:`duration` and
:func:`quote`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from controlplane.telemetry.base import (
    Aggregation,
    Matchers,
    Regex,
    check_quantile,
    check_query,
    histogram_base,
)

_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


def duration(seconds: float) -> str:
    """A Prometheus duration: ``30s``, or ``1500ms`` when not a whole number of seconds."""
    if not seconds > 0:
        raise ValueError(f"a duration must be > 0, got {seconds}")
    if float(seconds).is_integer():
        return f"{int(seconds)}s"
    return f"{max(1, round(seconds * 1000))}ms"


def quote(text: str) -> str:
    """A double-quoted scalar valid in both YAML and PromQL (JSON string syntax)."""
    return json.dumps(text, ensure_ascii=False)


def selector(metric: str, match: Matchers | None = None) -> str:
    """``metric{a="x",b=~"y"}``; names are checked, values quoted."""
    if not _METRIC_NAME.fullmatch(metric):
        raise ValueError(f"not a metric name: {metric!r}")
    parts = []
    for name, want in sorted((match or {}).items()):
        if not _LABEL_NAME.fullmatch(name):
            raise ValueError(f"not a label name: {name!r}")
        if isinstance(want, Regex):
            parts.append(f"{name}=~{quote(want.pattern)}")
        else:
            parts.append(f"{name}={quote(want)}")
    return f"{metric}{{{','.join(parts)}}}" if parts else metric


def _by(by: Sequence[str]) -> str:
    for name in by:
        if not _LABEL_NAME.fullmatch(name):
            raise ValueError(f"not a label name: {name!r}")
    return f"by ({', '.join(by)})"


def gauge_query(metric: str, *, by: Sequence[str], match: Matchers | None, agg: Aggregation) -> str:
    check_query(agg=agg)
    return f"{agg} {_by(by)} ({selector(metric, match)})"


def rate_query(metric: str, *, window_s: float, by: Sequence[str], match: Matchers | None) -> str:
    return f"sum {_by(by)} (rate({selector(metric, match)}[{duration(window_s)}]))"


# The label that tells apart the rates of one ``rates_query``; not a label any exporter here uses.
RATE_OF_LABEL = "llmsre_rate_of"


def rates_query(metrics: Sequence[str], *, window_s: float, by: Sequence[str],
                match: Matchers | None) -> str:
    """Several counters' rates in one query (so on the same samples), each result labelled with its
    counter's name in :data:`RATE_OF_LABEL`."""
    parts = [f'label_replace({rate_query(m, window_s=window_s, by=by, match=match)}, '
             f'"{RATE_OF_LABEL}", "{m}", "", "")' for m in metrics]
    return " or ".join(parts)


def ratio_query(numerator: str, denominator: str, *, window_s: float, match: Matchers | None) -> str:
    """The two rates' sums divided in one query, so that both are read on the same samples; "> 0" leaves
    no answer where the denominator did not move (rather than NaN or +Inf)."""
    top = rate_query(numerator, window_s=window_s, by=(), match=match)
    bottom = rate_query(denominator, window_s=window_s, by=(), match=match)
    return f"{top} / ({bottom} > 0)"


def quantile_query(histogram: str, q: float, *, window_s: float, by: Sequence[str],
                   match: Matchers | None) -> str:
    check_quantile(q)
    bucket = f"{histogram_base(histogram)}_bucket"
    return (f"histogram_quantile({float(q)!r}, "
            f"{rate_query(bucket, window_s=window_s, by=('le', *by), match=match)})")
