"""Test models: speech that never ends on its own (to hold requests open), a byte-level
tokenizer."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from mstar.engines.stateless import BatchedNode, batched
from mstar.graph import EMIT, DynamicLoop, GraphEdge, GraphNode, ModelGraph
from mstar.runtime.model import EngineType, Model, PreparedRequest, Request, SupportsAudioOutput

SAMPLE_RATE = 8000
CHUNK = 80


class EndlessTone(Model, SupportsAudioOutput):
    """Task "speech": a tone in chunks of 80 samples, `num_chunks` of them (default: endless)."""

    name = "endless-tone"
    audio_sample_rate = SAMPLE_RATE

    def __init__(self) -> None:
        tone = GraphNode(
            "tone",
            {"step", "limit"},
            [GraphEdge("tone", "step"), GraphEdge(EMIT, "audio", modality="audio")],
            signals={"done"},
        )
        self._graph = ModelGraph(
            name=self.name,
            walks={"speak": DynamicLoop(tone, max_iters=10**7, stop="done")},
            partitions={"Tone": ["speak"]},
            inputs={"tone": {"step", "limit"}},
        )

    def graph(self) -> ModelGraph:
        return self._graph

    def engine_types(self) -> dict[str, EngineType]:
        return {"tone": EngineType.STATELESS}

    def submodule(self, node: str, device: torch.device) -> BatchedNode:
        t = torch.arange(CHUNK, dtype=torch.float32) / SAMPLE_RATE

        def tone(x: Mapping[str, Any]) -> dict[str, Any]:
            step = int(x["step"])
            return {
                "step": step + 1,
                "audio": 0.5 * torch.sin(2 * math.pi * 440.0 * (t + step * CHUNK / SAMPLE_RATE)),
                "done": step + 1 >= int(x["limit"]),
            }

        return batched(tone)

    def tasks(self) -> tuple[str, ...]:
        return ("speech",)

    def preprocess(self, request: Request) -> PreparedRequest:
        if request.task != "speech":
            raise ValueError(f"task must be 'speech', got {request.task!r}")
        limit = int(request.data.get("num_chunks", 10**7))
        return PreparedRequest({"tone": {"step": 0, "limit": limit}})

    def first_walk(self, partition: str, state: Any) -> str | None:
        return "speak"

    def next_walk(self, partition: str, state: Any, finished: str) -> str | None:
        return None


# --- a tiny Llama with a byte-level tokenizer, built offline ---------------------------------

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _byte_chars() -> dict[int, str]:
    """Return GPT-2's byte-level alphabet: printable bytes stand for themselves, others move to
    256+."""
    keep = {
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    }
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def make_byte_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """Return a byte-level tokenizer: ids 0-255 are bytes, 256-258 are chat specials (257 ends a
    turn)."""
    vocab = {c: b for b, c in _byte_chars().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>", "<|endoftext|>"])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tiny_chat_llama(path: Path) -> Path:
    """Save a tiny random Llama with the byte-level tokenizer and its chat template in ``path``."""
    tokenizer = make_byte_tokenizer()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        tie_word_embeddings=False,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
