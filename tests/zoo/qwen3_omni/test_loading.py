"""Qwen3-Omni loads per node: each rank reads only its nodes' tensors, in the target dtype.

A placement with the thinker and the encoders on one rank and the talker and Code2Wav on
another must read disjoint sets of tensors (but the thinker's token embedding, which the
talker reads too), from the shards that hold them only, leave every other parameter on the
meta device, and give the full load's values and outputs.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import safetensors
import torch

from mstar.errors import CheckpointError
from mstar.runtime import AsyncEngine, EngineConfig, ModelSpec, Output, Request
from mstar.runtime.placement import NodeGroup, Placement
from mstar.zoo.hf_checkpoint import ShardReader, checkpoint_nbytes, read_safetensors_header
from mstar.zoo.qwen3_omni.checkpoint import load_qwen3_omni, make_random_checkpoint
from mstar.zoo.qwen3_omni.config import get_qwen3_omni_config
from mstar.zoo.qwen3_omni.model import Qwen3OmniModel
from mstar.zoo.qwen3_omni.modules.weights import NODE_WEIGHTS, Qwen3OmniWeights

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONFIG = "qwen3-omni-tiny"
THINKER_RANK = ("thinker", "audio_encoder", "vision_encoder")
TALKER_RANK = ("talker", "code2wav")
SHARED = {"thinker.model.embed_tokens.weight"}  # the talker projects its tts_* rows
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_checkpoint(
        get_qwen3_omni_config(CONFIG),
        tmp_path_factory.mktemp("qwen3_omni") / "sharded",
        seed=0,
        max_shard_size="400KB",
    )


@pytest.fixture(scope="module")
def full(sharded: Path) -> Qwen3OmniWeights:
    return load_qwen3_omni(sharded)


@pytest.fixture(scope="module")
def headers(sharded: Path) -> dict[str, tuple[Path, int]]:
    """Map every checkpoint tensor to its shard and its bytes."""
    out: dict[str, tuple[Path, int]] = {}
    for path in sorted(sharded.glob("*.safetensors")):
        out.update({n: (path, e.nbytes) for n, e in read_safetensors_header(path).items()})
    return out


class _Reads:
    """Every tensor read through `safetensors.safe_open` while installed, and every file opened."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.num_bytes = 0
        self.paths: set[Path] = set()
        self.num_opens = 0


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Reads]:
    record = _Reads()
    real = safetensors.safe_open

    def _recorded(name: str, tensor: torch.Tensor) -> torch.Tensor:
        record.names.append(name)
        record.num_bytes += tensor.numel() * tensor.element_size()
        return tensor

    class Counted:
        def __init__(self, path: str, **kwargs: Any) -> None:
            self.handle = real(path, **kwargs)
            record.paths.add(Path(path))
            record.num_opens += 1

        def get_tensor(self, name: str) -> torch.Tensor:
            return _recorded(name, self.handle.get_tensor(name))

        def get_slice(self, name: str) -> Any:
            rows = self.handle.get_slice(name)

            class Rows:
                def __getitem__(self, index: slice) -> torch.Tensor:
                    return _recorded(name, rows[index])

            return Rows()

        def __getattr__(self, attr: str) -> Any:
            return getattr(self.handle, attr)

        def __enter__(self) -> Counted:
            return self

        def __exit__(self, *exc: object) -> None:
            self.handle.__exit__(*exc)

    monkeypatch.setattr(safetensors, "safe_open", Counted)
    yield record


def _rank_names(headers: dict[str, tuple[Path, int]], nodes: tuple[str, ...]) -> set[str]:
    """Return the checkpoint tensors of a rank's nodes, by the checkpoint's own prefixes."""
    if nodes == THINKER_RANK:
        return {n for n in headers if n.startswith("thinker.")}
    return {n for n in headers if n.startswith(("talker.", "code2wav."))} | SHARED


def test_the_checkpoint_is_sharded_with_an_index(sharded: Path) -> None:
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 4


def test_each_rank_reads_only_its_nodes_tensors_once(
    sharded: Path,
    full: Qwen3OmniWeights,
    headers: dict[str, tuple[Path, int]],
    reads: _Reads,
) -> None:
    read_by_rank: list[set[str]] = []
    for nodes in (THINKER_RANK, TALKER_RANK):
        reads.names.clear()
        reads.paths.clear()
        reads.num_bytes = 0
        model = Qwen3OmniModel(CONFIG, checkpoint=str(sharded))  # a rank's process of its own
        for node in nodes:
            model.submodule(node, CPU)
        names = set(reads.names)
        want = _rank_names(headers, nodes)
        assert len(reads.names) == len(names), "a tensor was read twice"
        assert names == want, (sorted(names - want)[:5], sorted(want - names)[:5])
        assert reads.num_bytes == sum(headers[n][1] for n in want)
        assert reads.paths == {headers[n][0] for n in want}  # the shards holding them, only
        # What the rank's nodes do not read was never materialised; what they read is the full
        # load's.
        weights = model.load_weights(CPU, nodes)
        reference = dict(full.named_parameters())
        loaded = {n for n, p in weights.named_parameters() if not p.is_meta}
        for name, param in weights.named_parameters():
            if name in loaded:
                assert param.device == CPU and not param.requires_grad
                assert torch.equal(param, reference[name]), name
        prefixes = tuple(p for node in nodes for p in NODE_WEIGHTS[node])
        assert loaded == {n for n in reference if n.startswith(prefixes)}
        read_by_rank.append(names)
    thinker, talker = read_by_rank
    assert thinker & talker == SHARED
    assert sum(headers[n][1] for n in thinker | talker) == checkpoint_nbytes(sharded)


def test_nodes_on_one_device_share_one_load(
    sharded: Path, headers: dict[str, tuple[Path, int]], reads: _Reads
) -> None:
    model = Qwen3OmniModel(CONFIG, checkpoint=str(sharded))
    model.submodule("talker", CPU)
    model.submodule("thinker", CPU)  # the shared embedding is not read again
    weights = model.load_weights(CPU, ["talker"])  # nothing new
    thinker = {
        n for n in headers if n.startswith("thinker.model.") or n.startswith("thinker.lm_head.")
    }
    talker = {n for n in headers if n.startswith("talker.")} | SHARED
    assert len(reads.names) == len(set(reads.names)) and set(reads.names) == thinker | talker
    assert model.load_weights(CPU, ["code2wav", "audio_encoder"]) is weights
    assert all(p.is_meta == n.startswith("visual.") for n, p in weights.named_parameters())


def test_a_target_dtype_load_equals_the_full_float32_load_cast(
    sharded: Path, full: Qwen3OmniWeights, tmp_path: Path
) -> None:
    # The old loader built float32, filled it, then cast every parameter and floating buffer.
    bf16 = load_qwen3_omni(sharded, dtype=torch.bfloat16)
    cast = {
        n: t.to(torch.bfloat16) if t.is_floating_point() else t for n, t in full.named_buffers()
    }
    reference = dict(full.named_parameters())
    for name, param in bf16.named_parameters():
        assert param.dtype == torch.bfloat16, name
        assert torch.equal(param, reference[name].to(torch.bfloat16)), name
    for name, buffer in bf16.named_buffers():
        assert buffer.dtype == cast[name].dtype and torch.equal(buffer, cast[name]), name
    # A bfloat16 checkpoint widens to float32 exactly.
    config = get_qwen3_omni_config(CONFIG)
    written = make_random_checkpoint(config, tmp_path / "bf16", seed=0, dtype=torch.bfloat16)
    wide = load_qwen3_omni(written, config, nodes=["code2wav"])
    assert wide.code2wav.code_embedding.weight.dtype == torch.float32
    assert torch.equal(
        wide.code2wav.code_embedding.weight, bf16.code2wav.code_embedding.weight.float()
    )
    assert wide.thinker_text.lm_head.weight.is_meta


def test_the_shard_reader_releases_its_mapping_and_counts(
    sharded: Path, headers: dict[str, tuple[Path, int]], reads: _Reads
) -> None:
    path = sorted(sharded.glob("*.safetensors"))[0]
    names = [n for n, (p, _) in headers.items() if p == path]
    with ShardReader(window_bytes=1) as reader:  # a new handle for every tensor
        got = {n: reader.get_tensor(path, n).clone() for n in names}
    assert reader.num_bytes_read == sum(headers[n][1] for n in names)
    assert reader.paths_opened == {path} and reads.num_opens == len(names) > 1
    with safetensors.safe_open(str(path), framework="pt") as f:
        assert all(torch.equal(got[n], f.get_tensor(n)) for n in names)
    # A tensor over the window is copied in blocks of rows, the shard reopened between them.
    name = max(names, key=lambda n: headers[n][1])
    reads.num_opens = reads.num_bytes = 0
    with ShardReader(window_bytes=headers[name][1] // 3) as reader:
        out = torch.empty(got[name].shape, dtype=torch.bfloat16)
        reader.copy_into(path, name, out)
    assert torch.equal(out, got[name].to(torch.bfloat16))
    assert reads.num_bytes == reader.num_bytes_read == headers[name][1] and reads.num_opens >= 3
    with ShardReader() as reader, pytest.raises(CheckpointError, match="has shape"):
        reader.copy_into(path, name, torch.empty(3))


def test_unknown_nodes_and_bad_checkpoints_still_fail_clearly(sharded: Path) -> None:
    with pytest.raises(KeyError, match="no node 'speaker'"):
        load_qwen3_omni(sharded, nodes=["speaker"])
    model = Qwen3OmniModel(CONFIG, checkpoint=str(sharded))
    with pytest.raises(KeyError):
        model.submodule("speaker", CPU)


def _split(outputs: list[Output]) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    text = [int(o.data) for o in outputs if o.modality == "text"]
    codes = torch.stack([o.data for o in outputs if o.name == "talker_codes"], dim=1)
    audio = torch.cat([o.data for o in outputs if o.modality == "audio"])
    return text, codes, audio


REQUEST = {
    "text": "Hello there",
    "max_tokens": 8,
    "talker_temperature": 0.0,
    "seed": 1,
    "max_audio_frames": 40,
    "return_codes": True,
}


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_a_split_placement_in_worker_processes_answers_as_one_full_load(
    sharded: Path,
) -> None:
    kwargs = {"config": CONFIG, "checkpoint": str(sharded), "codec_batch_size": 1}
    colocated = Qwen3OmniModel(colocated=True, **kwargs)
    async with await AsyncEngine.start(colocated) as engine:
        want = _split(await engine.run(Request("generate", REQUEST)))
    spec = ModelSpec("mstar.zoo.qwen3_omni.model:Qwen3OmniModel", kwargs)
    groups = (NodeGroup(list(THINKER_RANK), [0]), NodeGroup(list(TALKER_RANK), [1]))
    placement = Placement(groups, colocated.graph().name)
    # Each rank's process loads its own nodes' weights only (the rest stays on meta).
    config = EngineConfig(worker_processes=True)
    async with await AsyncEngine.start(spec, placement, config) as engine:
        got = _split(await engine.run(Request("generate", REQUEST)))
    assert got[0] == want[0] and len(want[0]) > 0
    assert torch.equal(got[1], want[1]) and want[1].shape[1] > 0
    assert torch.equal(got[2], want[2]) and want[2].numel() > 0
