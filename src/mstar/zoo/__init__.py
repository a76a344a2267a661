"""The model zoo: composite models declared as graphs plus walks."""

from __future__ import annotations

from mstar.zoo.registry import ZooEntry, list_models, make_model, model_options, resolve_model
from mstar.zoo.toy import (
    ToyConfig,
    ToyModel,
    ToyPlan,
    make_toy_graph,
    make_toy_inputs,
    make_toy_nodes,
)

__all__ = [
    "ToyConfig",
    "ToyModel",
    "ToyPlan",
    "ZooEntry",
    "list_models",
    "make_model",
    "model_options",
    "make_toy_graph",
    "make_toy_inputs",
    "make_toy_nodes",
    "resolve_model",
]
