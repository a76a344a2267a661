"""The reference interpreter against plain-Python loops written from each primitive's docstring."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
import torch

from mstar.errors import WalkDeadlockError, WalkExecutionError
from mstar.graph import (
    EMIT,
    Connection,
    DynamicLoop,
    Emission,
    GraphEdge,
    GraphNode,
    Loop,
    ModelGraph,
    Parallel,
    Sequential,
    StreamingGraphEdge,
    concat_values,
    run_reference,
)
from mstar.streaming import (
    Chunk,
    FixedChunkPolicy,
    LeftContextChunkPolicy,
    SlidingWindowChunkPolicy,
    StreamBuffer,
)
from mstar.streaming.policies import ChunkPolicy
from mstar.zoo.toy import (
    ToyConfig,
    ToyPlan,
    make_toy_graph,
    make_toy_inputs,
    make_toy_nodes,
    prepare_toy_images,
)


class Plan:
    """Walk order per partition: a list run once, or repeated while ``repeat`` says so."""

    def __init__(
        self, order: Mapping[str, list[str]], repeat: frozenset[str] = frozenset()
    ) -> None:
        self.order, self.repeat = order, repeat

    def first_walk(self, partition: str, state: Any) -> str | None:
        walks = self.order.get(partition, [])
        return walks[0] if walks else None

    def next_walk(self, partition: str, state: Any, finished: str) -> str | None:
        if finished in self.repeat:
            return finished
        walks = self.order[partition]
        i = walks.index(finished)
        return walks[i + 1] if i + 1 < len(walks) else None


def values(emissions: list[Emission], name: str) -> list[Any]:
    return [e.value for e in emissions if e.name == name]


W = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))


def test_sequential_and_persist_across_walks() -> None:
    # walk one: a -> b; b's output persists into walk two, where a runs again on it.
    a = GraphNode("a", {"x"}, [GraphEdge("b", "h")])
    b = GraphNode(
        "b", {"h"}, [GraphEdge("a", "x", persist=True), GraphEdge(EMIT, "y", modality="latent")]
    )
    g = ModelGraph(
        {"one": Sequential([a, b]), "two": Sequential([a, b])},
        {"P": ["one", "two"]},
        inputs={"a": {"x"}},
    )
    fns = {
        "a": lambda i: {"h": W @ i["x"]},
        "b": lambda i: {"x": torch.tanh(i["h"]), "y": i["h"].sum()},
    }
    x0 = torch.ones(4)
    got = values(run_reference(g, fns, {"a": {"x": x0}}, Plan({"P": ["one", "two"]})), "y")
    # plain Python
    want, x = [], x0
    for _ in range(2):
        h = W @ x
        x = torch.tanh(h)
        want.append(h.sum())
    assert torch.equal(torch.stack(got), torch.stack(want))


def test_parallel_branches_see_the_same_inputs_and_are_gathered() -> None:
    # Branch a overwrites x for later nodes; branch b must still read the original x.
    a = GraphNode("a", {"x"}, [GraphEdge("c", "p"), GraphEdge("b", "x")])
    b = GraphNode("b", {"x"}, [GraphEdge("c", "q")])
    c = GraphNode("c", {"p", "q"}, [GraphEdge(EMIT, "out", modality="latent")])
    g = ModelGraph(
        {"w": Sequential([Parallel([a, b]), c])}, {"P": ["w"]}, inputs={"a": {"x"}, "b": {"x"}}
    )
    fns = {
        "a": lambda i: {"p": i["x"] * 2, "x": i["x"] * 100},
        "b": lambda i: {"q": i["x"] + 1},
        "c": lambda i: {"out": i["p"] - i["q"]},
    }
    x = torch.arange(4.0)
    (out,) = values(
        run_reference(g, fns, {"a": {"x": x}, "b": {"x": x}}, Plan({"P": ["w"]})), "out"
    )
    assert torch.equal(out, x * 2 - (x + 1))


def test_loop_feeds_back_and_accumulates() -> None:
    f = GraphNode(
        "f",
        {"x"},
        [
            GraphEdge("f", "x"),
            GraphEdge(EMIT, "step", modality="latent"),
            GraphEdge(EMIT, "acc", modality="latent"),
        ],
    )
    g = ModelGraph(
        {"w": Loop(f, 5, accumulated_outputs={"acc"})}, {"P": ["w"]}, inputs={"f": {"x"}}
    )
    fns = {"f": lambda i: {"x": torch.tanh(W @ i["x"]), "step": i["x"].sum(), "acc": i["x"][:2]}}
    em = run_reference(g, fns, {"f": {"x": torch.ones(4)}}, Plan({"P": ["w"]}))
    steps, accs = [], []
    x = torch.ones(4)
    for _ in range(5):
        steps.append(x.sum())
        accs.append(x[:2])
        x = torch.tanh(W @ x)
    assert [e.name for e in em] == ["step"] * 5 + ["acc"]  # accumulated: emitted once, at the end
    assert torch.equal(torch.stack(values(em, "step")), torch.stack(steps))
    assert torch.equal(values(em, "acc")[0], torch.cat(accs))


def test_nested_loops_accumulate_into_the_outer_loop() -> None:
    inner = GraphNode(
        "inner", {"x"}, [GraphEdge("inner", "x"), GraphEdge(EMIT, "v", modality="latent")]
    )
    g = ModelGraph(
        {"w": Loop(Loop(inner, 3, accumulated_outputs={"v"}), 2, accumulated_outputs={"v"})},
        {"P": ["w"]},
        inputs={"inner": {"x"}},
    )
    fns = {"inner": lambda i: {"x": i["x"] + 1, "v": i["x"].reshape(1)}}
    (v,) = values(
        run_reference(g, fns, {"inner": {"x": torch.tensor(0.0)}}, Plan({"P": ["w"]})), "v"
    )
    assert v.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


@pytest.mark.parametrize("horizon", [1, 3, 7, 12])
def test_dynamic_loop_stops_per_request(horizon: int) -> None:
    step = GraphNode(
        "step",
        {"t", "horizon"},
        [GraphEdge("step", "t"), GraphEdge(EMIT, "t", modality="action")],
        signals={"done"},
    )
    g = ModelGraph(
        {"roll": DynamicLoop(step, max_iters=10, stop="done")},
        {"P": ["roll"]},
        inputs={"step": {"t", "horizon"}},
    )
    fns = {"step": lambda i: {"t": i["t"] + 1, "done": bool(i["t"] + 1 >= i["horizon"])}}
    em = run_reference(
        g, fns, {"step": {"t": torch.tensor(0), "horizon": horizon}}, Plan({"P": ["roll"]})
    )
    # while i < max_iters: run; stop if done
    want, t, i = [], 0, 0
    while i < 10:
        t += 1
        want.append(t)
        i += 1
        if t >= horizon:
            break
    assert [int(v) for v in values(em, "t")] == want


def streaming_graph(policy: ChunkPolicy) -> ModelGraph:
    prod = GraphNode(
        "prod",
        {"i"},
        [GraphEdge("prod", "i"), StreamingGraphEdge("cons", "item")],
        signals={"done"},
    )
    cons = GraphNode("cons", {"item"}, [GraphEdge(EMIT, "seen", modality="latent")])
    return ModelGraph(
        {"produce": DynamicLoop(prod, max_iters=100, stop="done"), "consume": cons},
        {"Prod": ["produce"], "Cons": ["consume"]},
        connections=[Connection("Prod", "Cons", "item", policy)],
        inputs={"prod": {"i"}},
    )


@pytest.mark.parametrize(
    "policy",
    [
        FixedChunkPolicy(3),
        SlidingWindowChunkPolicy(4, 2),
        SlidingWindowChunkPolicy(28, 7),
        LeftContextChunkPolicy(3, 5),
    ],
    ids=str,
)
@pytest.mark.parametrize("n", [0, 1, 5, 28, 31])
def test_streaming_edges_fire_the_consumer_per_chunk(policy: ChunkPolicy, n: int) -> None:
    g = streaming_graph(policy)

    def prod(i: Mapping[str, Any]) -> dict[str, Any]:
        return {"i": i["i"] + 1, "item": torch.tensor(i["i"]), "done": i["i"] + 1 >= n}

    def cons(i: Mapping[str, Any]) -> dict[str, Any]:
        c: Chunk[torch.Tensor] = i["item"]
        return {"seen": (c.start, c.context_len, c.is_last, [int(x) for x in c.items])}

    plan = Plan(
        {"Prod": ["produce"] if n else [], "Cons": ["consume"]}, repeat=frozenset({"consume"})
    )
    got = values(run_reference(g, {"prod": prod, "cons": cons}, {"prod": {"i": 0}}, plan), "seen")
    buf: StreamBuffer[int] = StreamBuffer(policy)
    buf.put(list(range(n)))
    buf.close()
    want = [(c.start, c.context_len, c.is_last, list(c.items)) for c in buf.pop_ready()]
    assert got == want


def test_continue_after_done_keeps_the_consumer_running() -> None:
    g = streaming_graph(FixedChunkPolicy(1, continue_after_done=True))

    class ConsumerPlan(Plan):
        def next_walk(self, partition: str, state: Any, finished: str) -> str | None:
            if partition != "Cons":
                return None
            state["runs"] += 1
            return "consume" if state["runs"] < 5 else None

    fns = {
        "prod": lambda i: {"i": i["i"] + 1, "item": i["i"], "done": i["i"] >= 1},
        "cons": lambda i: {"seen": (list(i["item"].items), i["item"].is_last)},
    }
    state = {"runs": 0}
    plan = ConsumerPlan({"Prod": ["produce"], "Cons": ["consume"]})
    got = values(run_reference(g, fns, {"prod": {"i": 0}}, plan, state=state), "seen")
    # two items, then the end marker, then empty final chunks until the state machine stops
    assert got[:2] == [([0], False), ([1], False)]
    assert got[2:] == [([], True)] * (len(got) - 2)
    assert len(got) == 5


def test_node_failure_names_node_walk_and_request() -> None:
    g = streaming_graph(FixedChunkPolicy(1))

    def boom(i: Mapping[str, Any]) -> dict[str, Any]:
        raise ValueError("bad shape")

    plan = Plan({"Prod": ["produce"], "Cons": ["consume"]}, repeat=frozenset({"consume"}))
    with pytest.raises(
        WalkExecutionError,
        match=r"ValueError: bad shape \(node 'prod', walk 'produce', request 'r7'\)",
    ) as info:
        run_reference(g, {"prod": boom, "cons": boom}, {"prod": {"i": 0}}, plan, request_id="r7")
    assert (info.value.node, info.value.walk, info.value.request_id) == ("prod", "produce", "r7")


def test_unknown_outputs_and_missing_callables_are_errors() -> None:
    g = streaming_graph(FixedChunkPolicy(1))
    plan = Plan({"Prod": ["produce"], "Cons": ["consume"]}, repeat=frozenset({"consume"}))
    with pytest.raises(WalkExecutionError, match=r"unknown outputs \['oops'\]"):
        run_reference(
            g, {"prod": lambda i: {"oops": 1}, "cons": lambda i: {}}, {"prod": {"i": 0}}, plan
        )
    with pytest.raises(ValueError, match=r"no callable given for nodes \['cons'\]"):
        run_reference(g, {"prod": lambda i: {}}, {"prod": {"i": 0}}, plan)
    with pytest.raises(ValueError, match="not a walk of partition 'Cons'"):
        run_reference(
            g,
            {"prod": lambda i: {}, "cons": lambda i: {}},
            {},
            Plan({"Prod": [], "Cons": ["produce"]}),
        )


def test_partitions_waiting_on_each_other_deadlock_with_a_clear_error() -> None:
    a = GraphNode("a", {"x"}, [StreamingGraphEdge("b", "y")])
    b = GraphNode("b", {"y"}, [StreamingGraphEdge("a", "x")])
    g = ModelGraph(
        {"wa": a, "wb": b},
        {"A": ["wa"], "B": ["wb"]},
        connections=[
            Connection("A", "B", "y", FixedChunkPolicy(1)),
            Connection("B", "A", "x", FixedChunkPolicy(1)),
        ],
    )

    class Forever(Plan):
        def next_walk(self, partition: str, state: Any, finished: str) -> str | None:
            return finished

    with pytest.raises(WalkDeadlockError, match=r"partitions \['A', 'B'\] all wait"):
        run_reference(
            g, {"a": lambda i: {}, "b": lambda i: {}}, {}, Forever({"A": ["wa"], "B": ["wb"]})
        )


def test_concat_values() -> None:
    assert torch.equal(concat_values([torch.tensor(1), torch.tensor(2)]), torch.tensor([1, 2]))
    assert torch.equal(
        concat_values([torch.ones(2, 3), torch.zeros(1, 3)]),
        torch.cat([torch.ones(2, 3), torch.zeros(1, 3)]),
    )
    assert concat_values([[1], [2, 3]]) == [1, 2, 3]
    assert concat_values(["a", "b"]) == ["a", "b"]


def test_toy_model_speak_matches_a_hand_written_loop() -> None:
    cfg = ToyConfig()
    fns = make_toy_nodes(cfg, seed=3)
    inputs = make_toy_inputs("mstar", cfg)
    em = run_reference(make_toy_graph(cfg), fns, inputs, ToyPlan(), state="speech")
    # plain Python: prefill, then decode until EOS or the token budget, then vocode windows
    hidden = fns["encoder"]({"text": inputs["encoder"]["text"]})["hidden"]
    token, tokens = inputs["lm"]["token"], []
    for _ in range(cfg.max_new_tokens):
        out = fns["lm"]({"hidden": hidden, "token": token})
        token = out["token"]
        tokens.append(token)
        if out["eos"]:
            break
    assert [int(t) for t in values(em, "token")] == [int(t) for t in tokens]
    buf: StreamBuffer[torch.Tensor] = StreamBuffer(SlidingWindowChunkPolicy(4, 2))
    buf.put(tokens)
    buf.close()
    audio = [fns["vocoder"]({"token": c})["audio"] for c in buf.pop_ready()]
    got = values(em, "audio")
    assert len(got) == len(audio)
    assert all(torch.equal(x, y) for x, y in zip(got, audio, strict=True))
    # every token voiced once
    assert sum(len(a) for a in got) == len(tokens) * cfg.samples_per_token
    # the vocoder starts before the LM is done: streaming, not a batch at the end
    first_audio = next(i for i, e in enumerate(em) if e.name == "audio")
    assert first_audio < max(i for i, e in enumerate(em) if e.name == "token")


def test_toy_model_draw_matches_a_hand_written_loop() -> None:
    cfg = ToyConfig()
    fns = make_toy_nodes(cfg, seed=1)
    inputs = make_toy_inputs("a red square", cfg, seed=5)
    em = run_reference(make_toy_graph(cfg), fns, inputs, ToyPlan(), state="image")
    x = fns["init"]({"seed": 5})["x"]
    norms = []
    for _ in range(cfg.flow_steps):
        vc = fns["cond"]({"x": x, "prompt": inputs["cond"]["prompt"]})["v_cond"]
        vu = fns["uncond"]({"x": x})["v_uncond"]
        out = fns["combine"]({"x": x, "v_cond": vc, "v_uncond": vu})
        x = out["x"]
        norms.append(out["norm"])
    assert [e.name for e in em] == ["norm", "image"]
    assert torch.equal(values(em, "norm")[0], torch.stack(norms))
    assert torch.equal(values(em, "image")[0], fns["vae"]({"x": x})["image"])


def test_toy_model_edit_starts_the_flow_from_the_input_images() -> None:
    cfg = ToyConfig()
    fns = make_toy_nodes(cfg, seed=1)
    ramp = torch.arange(64, dtype=torch.uint8).reshape(8, 8) * 4
    images = prepare_toy_images(
        [ramp.numpy(), torch.full((16, 16, 3), 200, dtype=torch.uint8)], cfg
    )
    assert (
        images.shape == (2, 8, 8)
        and torch.equal(images[0], ramp)
        and bool((images[1] == 200).all())
    )
    inputs = make_toy_inputs("brighter", cfg, seed=5, images=images)
    em = run_reference(make_toy_graph(cfg), fns, inputs, ToyPlan(), state="image_edit")
    # plain Python: the VAE's inverse of each image, averaged, mixed with the seed's noise
    p = (images.reshape(2, -1).float() + 0.5) / 256
    noise = torch.randn(64, generator=torch.Generator().manual_seed(5))
    x = (1 - cfg.edit_strength) * torch.log(p / (1 - p)).mean(0) + cfg.edit_strength * noise
    for _ in range(cfg.flow_steps):
        vc = fns["cond"]({"x": x, "prompt": inputs["cond"]["prompt"]})["v_cond"]
        vu = fns["uncond"]({"x": x})["v_uncond"]
        x = fns["combine"]({"x": x, "v_cond": vc, "v_uncond": vu})["x"]
    assert [e.name for e in em] == ["norm", "image"]
    assert torch.equal(values(em, "image")[0], fns["vae"]({"x": x})["image"])
    # the input matters: another image, another result; the image task is untouched by it
    other = make_toy_inputs("brighter", cfg, seed=5, images=prepare_toy_images([255 - ramp], cfg))
    em_other = run_reference(make_toy_graph(cfg), fns, other, ToyPlan(), state="image_edit")
    assert not torch.equal(values(em_other, "image")[0], values(em, "image")[0])


@pytest.mark.parametrize(
    ("images", "message"),
    [
        ([], "1 to 16 images"),
        ([torch.zeros(4, 4, 2, dtype=torch.uint8)], r"\[H, W\], \[H, W, 3\] or \[H, W, 4\]"),
        ([torch.zeros(0, 4, dtype=torch.uint8)], "empty"),
        ([torch.full((4, 4), 0.5)], "uint8 pixels"),
        ([[[0, 300], [1, 2]]], "uint8 pixels"),
        (["not pixels"], "not an array of pixels"),
    ],
)
def test_toy_edit_inputs_are_checked(images: list[Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        prepare_toy_images(images)
