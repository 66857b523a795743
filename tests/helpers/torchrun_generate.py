"""Run by ``torchrun --nproc-per-node 2`` (tests/engine/test_tensor_parallel_engine.py): every
rank builds the same engine; rank 0's generates and prints its outputs as JSON, the other
rank serves it from inside ``LLM(...)`` and ends there.

    torchrun --standalone --nproc-per-node 2 tests/helpers/torchrun_generate.py MODEL ADAPTER
"""

import json
import sys

from detlora import LLM, LoRARequest, SamplingParams


def main() -> None:
    model, adapter = sys.argv[1:3]
    llm = LLM(model, enable_lora=True, max_loras=2, max_lora_rank=8, device="cpu",
              tensor_parallel_size=2)
    outs = llm.generate([[5, 6, 7, 8], [9, 10, 11, 12, 13]],
                        SamplingParams(max_tokens=6, logprobs=1, ignore_eos=True, temperature=0.0),
                        [LoRARequest("a", 1, adapter), None], use_tqdm=False)
    llm.engine.shutdown()
    print(json.dumps([[o.outputs[0].token_ids,
                       [{str(k): [v.logprob, v.rank] for k, v in d.items()}
                        for d in o.outputs[0].logprobs]]
                      for o in outs]))


if __name__ == "__main__":
    main()
