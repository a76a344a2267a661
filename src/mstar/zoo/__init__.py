"""The model zoo: composite models declared as graphs plus walks."""

from __future__ import annotations

from mstar.zoo.toy import ToyConfig, ToyPlan, make_toy_graph, make_toy_inputs, make_toy_nodes

__all__ = [
    "ToyConfig",
    "ToyPlan",
    "list_models",
    "make_toy_graph",
    "make_toy_inputs",
    "make_toy_nodes",
]

_MODELS = {
    "toy-composite": "three partitions (LM -> streamed vocoder; CFG flow-loop image), random weights",
}


def list_models() -> dict[str, str]:
    """Return the name and a one-line summary of every model in the zoo."""
    return dict(_MODELS)
