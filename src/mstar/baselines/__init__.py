"""Baselines: the slow, obvious implementations mstar's fast paths are checked and measured against.

Each recomputes what a zoo model's walks compute on the paged cache, the way its upstream
does it, with nothing cached, paged, forked or batched: the tests assert the served outputs
equal them, and the benchmarks in ``scripts/`` time them side by side. The benchmarks' peers
live here too: what a user writes without mstar (transformers ``generate`` behind a lock) and
the compute floors (the same work as bare engine steps). None of it serves through mstar.

- `mstar.baselines.bagel`: BAGEL with a dense cache per CFG context (`reference_generate`,
  `reference_understand`); `mstar.baselines.bagel_walks`: BAGEL's graph nodes on those dense
  caches, for the reference interpreter (`mstar.graph.run_reference`).
- `mstar.baselines.llm`: the LLM decode peers: transformers ``generate`` on each batch of
  waiting requests (`TransformersBatches`), vLLM's CPU build in a subprocess (`VllmPeer`), and
  the decode step's bandwidth and arithmetic floor (`decode_step_cost`, `add_floors`).
- `mstar.baselines.orpheus`: Orpheus TTS served by transformers ``generate`` one request at a
  time with SNAC on each window (`TransformersOrpheus`), and its compute floor, bare
  `KVCacheEngine` steps then codec calls (`OrpheusFloor`); both mask end of speech as served
  Orpheus does for ``ignore_eos``, so that every system does equal work.
- `mstar.baselines.pi05`: pi0.5 recomputing prefix and suffix at every flow step (the
  reference), and openpi's policy server: one request at a time through a dense-KV sampler
  (`OpenpiServer`, `DenseKVSampler`).
- `mstar.baselines.qwen3_omni`: Qwen3-Omni one component after another (the thinker to its
  end, then the talker, then Code2Wav), sampling as transformers' ``generate`` does.
- `mstar.baselines.qwen3_omni_serving`: Qwen3-Omni served without streaming between its
  components: a stage pipeline on mstar's kernels, each stage running its batch to the end
  (`StagePipeline`), and transformers' ``generate`` one request at a time
  (`TransformersQwen3Omni`).
- `mstar.baselines.transport`: the actor transports' raw floors: a bare asyncio-queue
  ping-pong, bare pyzmq sockets to a peer process, one copy into shared memory
  (`queue_floor`, `zmq_floor`, `zmq_blocking_floor`, `shm_copy_floors`).
- `mstar.baselines.vjepa2`: V-JEPA 2-AC's upstream rollout, every frame re-run at every step.
- `mstar.baselines.streaming`: a transformers streamer feeding asyncio queues, the way a server
  without mstar streams ``generate``'s tokens (`QueueStreamer`).
"""

from mstar.baselines.bagel import reference_generate, reference_understand
from mstar.baselines.llm import TransformersBatches, VllmPeer
from mstar.baselines.orpheus import OrpheusFloor, TransformersOrpheus
from mstar.baselines.pi05 import (
    DenseKVSampler,
    OpenpiServer,
    naive_sample_actions,
    naive_velocity,
)
from mstar.baselines.qwen3_omni_serving import StagePipeline, TransformersQwen3Omni
from mstar.baselines.streaming import QueueStreamer
from mstar.baselines.transport import (
    queue_floor,
    shm_copy_floors,
    zmq_blocking_floor,
    zmq_floor,
)
from mstar.baselines.vjepa2 import native_rollout, native_step

__all__ = [
    "DenseKVSampler",
    "OpenpiServer",
    "OrpheusFloor",
    "QueueStreamer",
    "StagePipeline",
    "TransformersBatches",
    "TransformersOrpheus",
    "TransformersQwen3Omni",
    "VllmPeer",
    "naive_sample_actions",
    "naive_velocity",
    "queue_floor",
    "native_rollout",
    "native_step",
    "reference_generate",
    "reference_understand",
    "shm_copy_floors",
    "zmq_blocking_floor",
    "zmq_floor",
]
