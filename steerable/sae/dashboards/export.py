"""Dashboards in the JSON layout Neuronpedia imports: sae-dashboard's ``NeuronpediaDashboardBatch``
(``batch-N.json``, one per ``batch_features`` features), each feature as
``NeuronpediaDashboardFeature.to_dict()`` writes it, plus ``maxActApprox``. Numbers are rounded
to 3 decimals as sae-dashboard's converter rounds them. docs/dashboards.md lists which fields are
filled and from what; the correlation tables and DFA fields stay empty.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the result module writes through this one
    from steerable.sae.dashboards.result import (
        Example,
        FeatureDashboard,
        FeatureDashboards,
    )


def _round(values: list[float]) -> list[float]:
    return [round(float(v), 3) for v in values]


def _centres(edges: list[float], used: int) -> list[float]:
    return [(edges[j] + edges[j + 1]) / 2 for j in range(used)]


def _activation(example: Example, low: float, high: float, contains: float) -> dict[str, Any]:
    # The DFA fields are empty, as sae-dashboard writes them when it computes no DFA.
    return {"bin_min": low, "bin_max": high, "bin_contains": contains, "tokens": example.token_strs,
            "values": _round(example.activations), "qualifying_token_index": example.offset,
            "dfa_values": [], "dfa_maxValue": 0, "dfa_targetIndex": -1}


def neuronpedia_feature(d: FeatureDashboard, num_texts: int, dataset: str = "") -> dict[str, Any]:
    """One feature as Neuronpedia's upload reads it. The top examples come first (``bin_min`` -1,
    ``bin_max`` the feature's max, ``bin_contains`` -1, as sae-dashboard marks its top group), then
    each quantile bin's samples from the highest bin down (``bin_contains``: the fraction of all
    tokens in the bin). The activation histogram runs to the last non-empty bin."""
    activations = [_activation(e, -1, round(d.max, 3), -1) for e in d.top]
    for group in reversed(d.quantiles):
        contains = group.count / d.tokens if d.tokens else 0.0
        activations += [_activation(e, round(group.low, 3), round(group.high, 3), contains) for e in group.examples]
    used = max((j + 1 for j, c in enumerate(d.histogram.counts) if c), default=0)
    logits_used = len(d.logits_histogram.counts)
    return {
        "feature_index": d.index,
        "neuron_alignment_indices": [], "neuron_alignment_values": [], "neuron_alignment_l1": [],
        "correlated_neurons_indices": [], "correlated_neurons_l1": [], "correlated_neurons_pearson": [],
        "correlated_features_indices": [], "correlated_features_l1": [], "correlated_features_pearson": [],
        "neg_str": [e.token_str for e in d.bottom_logits], "neg_values": _round([e.value for e in d.bottom_logits]),
        "pos_str": [e.token_str for e in d.top_logits], "pos_values": _round([e.value for e in d.top_logits]),
        "frac_nonzero": d.density,
        "freq_hist_data_bar_values": _round(_centres(d.histogram.edges, used)),
        "freq_hist_data_bar_heights": d.histogram.counts[:used],
        "logits_hist_data_bar_heights": d.logits_histogram.counts,
        "logits_hist_data_bar_values": _round(_centres(d.logits_histogram.edges, logits_used)),
        "n_prompts_total": num_texts,
        "n_tokens_in_prompt": 0,  # texts keep their own lengths
        "dataset": dataset,
        "decoder_weights_dist": [],
        "activations": activations,
        "vector": [],
        "maxActApprox": round(d.max, 3),
    }


def neuronpedia_batches(dash: FeatureDashboards, batch_features: int = 128, model_id: str = "",
                        sae_set: str = "", dataset: str = "") -> Iterator[dict[str, Any]]:
    """``NeuronpediaDashboardBatch`` dicts of ``batch_features`` features each, in feature order."""
    features = dash.features
    for start in range(0, len(features), batch_features):
        yield {"model_id": model_id or dash.settings.model, "layer": dash.settings.layer,
               "sae_set": sae_set or dash.settings.sae, "sae_id_suffix": None,
               "features": [neuronpedia_feature(dash[i], dash.settings.num_texts, dataset)
                            for i in features[start:start + batch_features]]}
