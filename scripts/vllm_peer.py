"""vLLM's CPU build as a streaming peer for `bench_llm.py`, run by the peer's own interpreter.

`bench_llm.py --peer vllm` starts this file with the Python of the vLLM virtual environment
(`scripts/setup_vllm_peer.sh` makes it), so mstar's own environment never imports vLLM. The
two talk JSON lines: the configuration comes as the first argument; requests come on stdin,
one object per line, and each engine step's new tokens go back on stdout as they are made:

```
 stdin   {"id": "p3", "prompt": [17, 4, ...], "max_tokens": 256}       a request (token ids)
         {"exit": true}                                                   stop
 stdout  {"ready": true, "torch_threads": 1, "vllm": "0.32.0"}          once, when loaded
         {"step": [["p3", [912], false], ...]}                           per step: id, new tokens, done
```

The engine is vLLM's `LLMEngine` with greedy sampling, `ignore_eos` and delta outputs, eager
(no graph capture), without a tokenizer; requests that arrive while it steps join the next
step (continuous batching). vLLM's own logs go to stderr: stdout carries only these lines.
"""  # noqa: E501 (a table or diagram)

from __future__ import annotations

import json
import os
import select
import sys
from typing import Any


def _serve(config: dict[str, Any], out: Any) -> None:
    import torch
    import vllm
    from vllm import EngineArgs, LLMEngine, SamplingParams, TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    args = EngineArgs(
        model=config["model"],
        dtype=config["dtype"],
        load_format=config.get("load_format", "auto"),
        enforce_eager=True,
        skip_tokenizer_init=True,
        max_model_len=int(config["max_model_len"]),
        max_num_seqs=int(config["max_num_seqs"]),
        seed=0,
    )
    engine = LLMEngine.from_engine_args(args)

    def emit(message: dict[str, Any]) -> None:
        out.write(json.dumps(message) + "\n")
        out.flush()

    emit({"ready": True, "torch_threads": torch.get_num_threads(), "vllm": vllm.__version__})
    pending = b""
    closing = False
    while not closing or engine.has_unfinished_requests():
        # Block for input only when idle; between steps take whatever has arrived.
        timeout = 0.0 if engine.has_unfinished_requests() else None
        while not closing and select.select([0], [], [], timeout)[0]:
            chunk = os.read(0, 1 << 16)
            if not chunk:
                closing = True
                break
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if not line.strip():
                    continue
                request = json.loads(line)
                if request.get("exit"):
                    closing = True
                    break
                n = int(request["max_tokens"])
                params = SamplingParams(
                    temperature=0.0,
                    max_tokens=n,
                    min_tokens=n,
                    ignore_eos=True,
                    detokenize=False,
                    output_kind=RequestOutputKind.DELTA,
                )
                engine.add_request(
                    str(request["id"]), TokensPrompt(prompt_token_ids=request["prompt"]), params
                )
            timeout = 0.0
        if not engine.has_unfinished_requests():
            continue
        # One line per step, so that streaming costs the peer one write whatever the batch.
        step = [
            [
                output.request_id,
                [int(t) for o in output.outputs for t in o.token_ids],
                bool(output.finished),
            ]
            for output in engine.step()
        ]
        if step:
            emit({"step": step})


def main() -> int:
    """Serve requests on stdin with the configuration in ``sys.argv[1]`` (JSON)."""
    config = json.loads(sys.argv[1])
    # This process's stdout carries the protocol only: everything else (vLLM's logs, its
    # engine process's output) goes to stderr, through the inherited descriptor 1 too.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    _serve(config, out)
    return 0


if __name__ == "__main__":  # vLLM starts its engine in a child process
    sys.exit(main())
