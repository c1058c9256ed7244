"""Feature dashboards of an SAE over a corpus in one pass: top and quantile examples with their
windows, activation statistics and histograms, and logit effects, for every feature at once;
exported in the layout Neuronpedia imports (docs/dashboards.md).

Modules, one role each: ``grid`` (exact mergeable bins, sample keys), ``accumulate`` (the device
side of the pass), ``merge`` (example lists), ``state`` (everything gathered, mergeable),
``logits`` (logit tables), ``result`` (what users read), ``export`` (Neuronpedia JSON), ``files``
(the directory), ``driver`` (the pass)."""

from steerable.sae.dashboards.driver import DashboardRun, feature_dashboards, plan, run_shards
from steerable.sae.dashboards.result import (
    Example,
    FeatureDashboard,
    FeatureDashboards,
    Histogram,
    LogitEntry,
    QuantileGroup,
)
from steerable.sae.dashboards.state import DashboardState

__all__ = ["feature_dashboards", "plan", "run_shards", "DashboardRun", "FeatureDashboards", "FeatureDashboard",
           "Example", "QuantileGroup", "Histogram", "LogitEntry", "DashboardState"]
